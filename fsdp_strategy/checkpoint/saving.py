"""How a checkpoint save ends: together on every rank, with a failure named and its files removed.

A save is written under a hidden staging name (:mod:`~fsdp_strategy.checkpoint.staging`) and put in place when
complete (:mod:`~fsdp_strategy.checkpoint.writing`). Around that, this module:

- turns a failed write on any rank into the same :class:`CheckpointSaveError` on every rank
  (:func:`settle`), naming the checkpoint and the cause, a full disk included, and removes the
  attempt's staging files;
- starts background saves (:class:`~fsdp_strategy.checkpoint.background.BackgroundSave`) and settles them;
- decides which ``CheckpointIO`` plugins a strategy can hand its checkpoints to.
"""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_strategy.checkpoint import writing
from fsdp_strategy.checkpoint.background import SAVE_ERRORS, BackgroundSave, snapshot
from fsdp_strategy.checkpoint.layout import split_checkpoint
from fsdp_strategy.checkpoint.location import Location, location_of
from fsdp_strategy.checkpoint.trainer_state import check_trainer_state, write_trainer_state
from fsdp_strategy.sizes import format_bytes

__all__ = [
    "CheckpointSaveError",
    "attempt",
    "check_checkpoint_io",
    "describe_failure",
    "is_default_checkpoint_io",
    "remover",
    "save_full",
    "save_sharded",
    "save_through",
    "settle",
]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# A write fails for want of space when the filesystem is full to the last blocks; a failure whose
# OSError torch hid is taken for a full disk when less than this is free where it was writing.
_NEARLY_FULL_BYTES = 1 << 20


class CheckpointSaveError(OSError):
    """A checkpoint could not be saved; raised on every rank, naming the checkpoint and the cause.

    ``errno`` is the cause's (``errno.ENOSPC`` for a full disk) where it is known, and ``checkpoint``
    the path that was being saved. The earlier checkpoints are left as they were.
    """

    def __init__(self, message: str, *, checkpoint: Path, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return str(self.args[0])


# --- failures -----------------------------------------------------------------------------------


def attempt(action: Callable[[], Any]) -> BaseException | None:
    """Runs ``action``; returns its error instead of raising it, so that every rank reaches :func:`settle`."""
    try:
        action()
    except SAVE_ERRORS as error:
        return error
    return None


def describe_failure(error: BaseException, *, checkpoint: Path | str, rank: int) -> tuple[str, int | None]:
    """What went wrong in a save, as one clause naming the cause and the failing rank, and its errno.

    A ``CheckpointException`` from DCP carries every failing rank's error; the first one is described.
    """
    failing_rank, cause = rank, error
    if isinstance(error, CheckpointException) and error.failures:
        failing_rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
    os_error = writing.os_error_in(cause)
    parent = location_of(checkpoint).parent
    where = parent.value
    free = parent.free_bytes() if os_error is None else None
    if os_error is None and free is not None and free < _NEARLY_FULL_BYTES:
        hidden = f"{type(cause).__name__}: {_first_line(cause)}"
        return (
            f"no space left on device in '{where}' (rank {failing_rank} was writing; {format_bytes(free)} free there;"
            f" torch reported {hidden})"
        ), errno.ENOSPC
    if os_error is not None and os_error.errno in _NO_SPACE:
        return f"{os.strerror(os_error.errno).lower()} in '{where}' (rank {failing_rank} was writing)", os_error.errno
    if os_error is not None:
        return f"{_first_line(os_error)} (rank {failing_rank})", os_error.errno
    return f"{type(cause).__name__}: {_first_line(cause)} (rank {failing_rank})", None


def settle(
    error: BaseException | None,
    *,
    checkpoint: Path | str,
    staging: Location | None,
    rank: int,
    plugin: str | None = None,
) -> None:
    """Every rank, once its part of a save is done: raises on every rank if any rank failed.

    ``error`` is this rank's failure (``None`` if its part succeeded). On failure every rank removes
    the attempt's ``staging`` entry and raises :class:`CheckpointSaveError` with the first failing
    rank's description; a failing rank chains its own error. A ``plugin`` (CheckpointIO) error is
    re-raised as it is on the rank where the plugin raised it, as under DDP.
    """
    report = None if error is None else _report(error, checkpoint=checkpoint, rank=rank, plugin=plugin)
    reports = [report]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
    failures = [r for r in reports if r is not None]
    if not failures:
        return
    if staging is not None:
        _discard(staging)
    if error is not None and plugin is not None:
        raise error
    message, code = failures[0]
    suffix = "" if plugin else " The earlier checkpoints are intact; the partial files of this attempt were removed."
    raise CheckpointSaveError(
        f"Could not save checkpoint '{checkpoint}': {message}.{suffix}", checkpoint=checkpoint, errno=code
    ) from error


def _report(error: BaseException, *, checkpoint: Path | str, rank: int, plugin: str | None) -> tuple[str, int | None]:
    if plugin is not None:
        return (
            f"the CheckpointIO plugin {plugin} raised {type(error).__name__} on rank {rank}: {_first_line(error)}",
            None,
        )
    return describe_failure(error, checkpoint=checkpoint, rank=rank)


def _discard(staging: Location) -> None:
    # Every rank removes the entry (on node-local disks each holds its own), so a peer may be
    # removing the same files at the same time.
    for _ in range(3):
        try:
            writing.remove_path(staging)
            return
        except FileNotFoundError:
            continue
        except OSError as error:
            warnings.warn(f"Could not remove '{staging}' after a failed save: {error}.", stacklevel=2)
            return


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)


# --- the saves ----------------------------------------------------------------------------------


def save_sharded(
    checkpoint: dict[str, Any],
    path: Location | Path | str,
    token: str,
    *,
    rank: int,
    background: BackgroundSave | None,
    group: Callable[[], Any],
) -> None:
    """Every rank: shards into the staging directory, then (rank 0) ``meta.pt`` and the rename into place.

    With ``background`` the writing continues in DCP's thread over the process group ``group()``;
    its outcome is settled by the next wait.
    """
    path = location_of(path)
    staging = writing.staging_path(path, token)
    tensors, rest = split_checkpoint(checkpoint)
    # Refuse trainer state that torch.save cannot write, on every rank, before any rank starts writing.
    trainer_state_data = check_trainer_state(rest, checkpoint=path.value)
    if background is None:
        error = attempt(lambda: _save_and_publish(staging, path, tensors, trainer_state_data, rank=rank))
        settle(error, checkpoint=path.value, staging=staging, rank=rank)
        return
    # Tensors are copied to host memory before async_save returns, and the trainer state is pickled
    # already (the bytes written to meta.pt); training may change both after.
    future = dcp.async_save(tensors, storage_writer=writing.shard_writer(staging), process_group=group())
    finish = (
        (lambda: (write_trainer_state(staging, trainer_state_data), writing.publish(staging, path)))
        if rank == 0
        else None
    )
    background.submit(future, checkpoint=path.value, staging=staging, then=finish)


def _save_and_publish(
    staging: Location, path: Location, tensors: dict[str, Any], trainer_state: bytes, *, rank: int
) -> None:
    writing.write_sharded(staging, tensors, trainer_state, is_rank_zero=rank == 0)
    if rank == 0:
        writing.publish(staging, path)


def save_full(
    checkpoint: dict[str, Any],
    path: Location | Path | str,
    token: str,
    *,
    rank: int,
    background: BackgroundSave | None,
    live: Callable[[], set[int]],
) -> None:
    """Rank 0 writes one file, staged and renamed into place; every rank settles the outcome.

    With ``background`` rank 0 writes a :func:`snapshot` of the tensors in ``live()`` storages on a
    thread; every rank records the save, so that the next wait settles it on all of them.
    """
    path = location_of(path)
    staging = writing.staging_path(path, token)
    if background is not None:
        work = partial(writing.save_full_file, path, snapshot(checkpoint, live()), token) if rank == 0 else None
        background.submit(work, checkpoint=path.value, staging=staging)
        return
    error = attempt(lambda: writing.save_full_file(path, checkpoint, token)) if rank == 0 else None
    settle(error, checkpoint=path.value, staging=staging, rank=rank)


def save_through(
    plugin: CheckpointIO,
    checkpoint: dict[str, Any],
    filepath: Any,
    storage_options: Any,
    *,
    path: Location | Path | str,
    rank: int,
) -> None:
    """Rank 0 hands the checkpoint to a ``CheckpointIO`` plugin, as DDP does; every rank settles the outcome."""
    save = lambda: plugin.save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # noqa: E731
    error = attempt(save) if rank == 0 else None
    settle(error, checkpoint=location_of(path).value, staging=None, rank=rank, plugin=type(plugin).__name__)


# --- CheckpointIO plugins -----------------------------------------------------------------------


def is_default_checkpoint_io(plugin: CheckpointIO) -> bool:
    """Lightning's own ``TorchCheckpointIO`` (not a subclass): its files are written by this package, staged."""
    return type(plugin) is TorchCheckpointIO


def check_checkpoint_io(
    plugin: CheckpointIO, *, sharded: bool, async_save: bool, strategy: str, state_dict_type: str = "sharded"
) -> None:
    """Refuses, before training, a ``CheckpointIO`` plugin that the strategy's checkpoints cannot go through
    (``sharded``: directories, written as ``state_dict_type`` names)."""
    if is_default_checkpoint_io(plugin):
        return
    name = type(plugin).__name__
    if sharded:
        raise ValueError(
            f"The CheckpointIO plugin {name} saves single checkpoint files, and {strategy} saves a directory of"
            f" shards (`state_dict_type='{state_dict_type}'`) that it cannot write. Pass"
            f' `{strategy}(state_dict_type="full")` to save one file per checkpoint through {name}, as DDP does,'
            " or remove the plugin."
            + (
                " For background saves of shards, use `async_save=True` instead."
                if isinstance(plugin, AsyncCheckpointIO)
                else ""
            )
        )
    if async_save:
        background = (
            f"{name} saves in the background itself"
            if isinstance(plugin, AsyncCheckpointIO)
            else f"to save in the background through {name}, wrap it in"
            " `lightning.pytorch.plugins.io.AsyncCheckpointIO`, as with DDP"
        )
        raise ValueError(
            f"`{strategy}(async_save=True)` writes checkpoints with its own background thread and cannot run the"
            f" CheckpointIO plugin {name} there. Pass `async_save=False`; {background}."
        )


def remover(plugin: CheckpointIO) -> Callable[[Any], Any]:
    """How a replaced checkpoint is removed: by the plugin, or (staged files and shard directories) here."""
    if is_default_checkpoint_io(plugin):
        return writing.remove_path
    return plugin.remove_checkpoint
