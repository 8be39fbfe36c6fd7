"""Writing a checkpoint's files and putting them in place: staged under a hidden name, then renamed (or, on a URL,
named by a manifest written in one go), so that a crash at any moment leaves a complete checkpoint behind.

:func:`save_sharded` writes a Distributed Checkpoint directory (every rank its shards, rank 0 ``meta.pt``),
:func:`save_full_file` one ordinary Lightning file; :func:`publish` gives a written checkpoint its final name.
What goes into them is :mod:`~fsdp_strategy.checkpoint.state_dicts`' and :mod:`~fsdp_strategy.checkpoint.layout`'s; how a save ends on every rank,
:mod:`~fsdp_strategy.checkpoint.saving`'s.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from fsdp_strategy._compat import FsspecWriter
from fsdp_strategy.checkpoint import storage
from fsdp_strategy.checkpoint.layout import split_checkpoint
from fsdp_strategy.checkpoint.location import LocalLocation, Location, location_of
from fsdp_strategy.checkpoint.trainer_state import check_trainer_state, write_trainer_state

__all__ = [
    "PARTIAL_PREFIX",
    "RemoteShardWriter",
    "ShardWriter",
    "os_error_in",
    "publish",
    "remove_path",
    "save_full_file",
    "save_sharded",
    "shard_writer",
    "staging_path",
    "write_sharded",
]

PARTIAL_PREFIX = ".partial-"


def staging_path(path: Any, token: str) -> Location:
    """Where a checkpoint is written before it becomes visible as ``path``.

    Hidden, and without the word "last", so that neither a directory listing nor Lightning's
    ``ckpt_path="last"`` lookup ever takes a half-written checkpoint. On a URL, the prefix that keeps the
    shards for good, which the manifest written under ``path`` names (see :mod:`fsdp_strategy.checkpoint.storage`).
    """
    where = location_of(path)
    prefix = storage.DATA_PREFIX if where.remote else PARTIAL_PREFIX
    return where.parent.join(f"{prefix}{token}")


def save_sharded(staging: Any, checkpoint: dict[str, Any], *, is_rank_zero: bool) -> None:
    """:func:`write_sharded` of a whole checkpoint dict."""
    tensors, rest = split_checkpoint(checkpoint)
    write_sharded(staging, tensors, check_trainer_state(rest, checkpoint=location_of(staging).value), is_rank_zero)


def write_sharded(staging: Any, tensors: dict[str, Any], trainer_state: bytes, is_rank_zero: bool) -> None:
    """Every rank writes its shards of ``tensors`` into ``staging``; then rank 0 writes ``trainer_state`` (the
    bytes :func:`~fsdp_strategy.checkpoint.trainer_state.check_trainer_state` returned) to ``meta.pt``.

    When this returns on rank 0, every rank has written its shards: DCP's coordinator writes
    ``.metadata`` only after gathering all ranks' write results. A rank's failure is raised on every
    rank by DCP (as ``CheckpointException``), so rank 0 writes ``meta.pt`` only after all shards are in.
    """
    dcp.save(tensors, storage_writer=shard_writer(staging))
    if is_rank_zero:
        write_trainer_state(staging, trainer_state)


def shard_writer(staging: Any) -> FileSystemWriter:
    """DCP's writer for the staging location: a local directory, or a prefix behind a URL."""
    where = location_of(staging)
    return (RemoteShardWriter if where.remote else ShardWriter)(where.value)


class _RaisingOSError:
    """DCP's writers, except that a failed write raises the ``OSError`` behind it.

    torch's zip writer turns a failed ``write`` (a full disk) into ``RuntimeError: ... unexpected pos``,
    keeping the ``OSError`` only as its ``__context__``; DCP then pickles the failing rank's error to
    every rank, which drops that context. Raising the ``OSError`` itself keeps its errno on every rank.
    """

    def write_data(self, plan: Any, planner: Any) -> Any:
        with _raising_os_error():
            return super().write_data(plan, planner)  # type: ignore[misc]

    def finish(self, metadata: Any, results: Any) -> None:
        with _raising_os_error():
            super().finish(metadata, results)  # type: ignore[misc]


class ShardWriter(_RaisingOSError, FileSystemWriter):
    """DCP's file writer for a local directory (see :class:`_RaisingOSError`)."""


class RemoteShardWriter(_RaisingOSError, FsspecWriter):
    """DCP's writer over fsspec (``s3://``, ``memory://``, ...; see :class:`_RaisingOSError`)."""


@contextmanager
def _raising_os_error() -> Generator[None, None, None]:
    try:
        yield
    except Exception as error:
        cause = os_error_in(error)
        if cause is None or cause is error:
            raise
        raise OSError(cause.errno, cause.strerror, cause.filename) from error


def os_error_in(error: BaseException) -> OSError | None:
    """The first ``OSError`` in ``error``'s chain of causes and contexts (``error`` itself included)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def publish(staging: Any, path: Any) -> None:
    """Rank 0: gives a completely written checkpoint its final name, replacing an older one at that name.

    The older checkpoint is renamed aside first (``<name>.previous``), then removed once the new
    one is in place, so a crash at any moment leaves a complete checkpoint behind. On a URL the name
    is a manifest naming ``staging``, written in one go; the older checkpoint's files are removed after.
    """
    where, staging = location_of(path), location_of(staging)
    if not isinstance(where, LocalLocation) or not isinstance(staging, LocalLocation):  # a URL: no rename there
        replaced = storage.published_data(where)
        storage.write_manifest(where, staging.name)
        if replaced is not None and replaced != staging:
            replaced.remove()
        return
    previous = where.parent.join(where.name + ".previous")
    if where.exists():
        previous.remove()
        where.rename(previous)
    staging.rename(where)
    previous.remove()


def save_full_file(path: Any, checkpoint: dict[str, Any], token: str) -> None:
    """Rank 0: one ordinary Lightning checkpoint file, written aside and renamed into place.

    The directory is created as Lightning's ``TorchCheckpointIO`` creates it; a failed write removes
    its staging file and leaves any older checkpoint at ``path`` as it was. On a URL the file is written
    as DDP writes it there (Lightning's ``TorchCheckpointIO``: one upload, which replaces an older object
    at once); the files of a sharded checkpoint it replaces are removed after.
    """
    where = location_of(path)
    if not isinstance(where, LocalLocation):
        from lightning.fabric.plugins import (
            TorchCheckpointIO,  # what DDP writes files on URLs with
        )

        replaced = storage.published_data(where)
        TorchCheckpointIO().save_checkpoint(checkpoint, str(where))
        if replaced is not None:
            replaced.remove()
        return
    where.parent.makedirs()
    staging = staging_path(where, token)
    try:
        with staging.open("wb") as file:  # a file object: torch derives an archive name from a path's stem
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        staging.remove()
        raise
    if where.is_dir():
        publish(staging, where)
    else:
        os.replace(staging.value, where.value)


def remove_path(path: Any) -> None:
    """Removes a checkpoint, or a staging entry, wherever it is (see :func:`~fsdp_strategy.checkpoint.storage.remove`)."""
    storage.remove(path)
