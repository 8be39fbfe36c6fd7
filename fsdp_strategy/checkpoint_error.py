"""The error of a checkpoint that is damaged, unsafe to unpickle or saved from another model.

Every check of a checkpoint raises it (:mod:`fsdp_strategy.dcp_metadata`, :mod:`fsdp_strategy.verify`,
:mod:`fsdp_strategy.trainer_state`, :mod:`fsdp_strategy.checkpoint`), so that one ``except`` catches them
all; it is public as ``fsdp_strategy.CheckpointError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CheckpointError", "damaged", "first_line", "read_checkpoint_file", "refused"]


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


def read_checkpoint_file(checkpoint: Any, name: str) -> bytes:
    """The bytes of the file ``name`` of a checkpoint directory (a path, a URL or its
    :class:`~fsdp_strategy.storage.CheckpointFiles`); a missing, unreadable or empty one is damaged."""
    from fsdp_strategy.storage import checkpoint_files

    files = checkpoint_files(checkpoint)
    if not files.is_file(name):
        detail = "is not a file" if files.exists(name) else "is missing"
        raise damaged(files.name, name, f"'{name}' {detail} (a save that was interrupted leaves the directory so).")
    try:
        data = files.read_bytes(name)
    except OSError as error:
        raise damaged(files.name, name, f"'{name}' cannot be read ({type(error).__name__}: {error}).") from error
    if not data:
        raise damaged(files.name, name, f"'{name}' is empty (0 bytes).")
    return data


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, to quote a cause inside a sentence."""
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"
