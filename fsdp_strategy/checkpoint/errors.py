"""The error of a checkpoint that is damaged, unsafe to unpickle or saved from another model.

Every check of a checkpoint raises it (:mod:`fsdp_strategy.checkpoint.dcp_metadata`, :mod:`fsdp_strategy.checkpoint.verify`,
:mod:`fsdp_strategy.checkpoint.trainer_state`, :mod:`fsdp_strategy.checkpoint.state_dicts`), so that one ``except`` catches them
all; it is public as ``fsdp_strategy.CheckpointError``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CheckpointError", "damaged", "first_line", "refused"]


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, unsafe to unpickle or saved from another model.

    The message names the checkpoint directory and the file at fault; both are also attributes.
    """

    def __init__(self, message: str, *, checkpoint: Path | str | None = None, file: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.file = file


def damaged(checkpoint: Path | str, file: str, detail: str) -> CheckpointError:
    return CheckpointError(f"Checkpoint '{checkpoint}' is damaged: {detail}", checkpoint=checkpoint, file=file)


def refused(checkpoint: Path | str, file: str, detail: str) -> CheckpointError:
    return CheckpointError(f"Checkpoint '{checkpoint}' is refused: {detail}", checkpoint=checkpoint, file=file)


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, to quote a cause inside a sentence."""
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"
