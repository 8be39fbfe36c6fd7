"""Writing a checkpoint's files and putting them in place: staged under a hidden name, then renamed (or, on a URL,
named by a manifest written in one go), so that a crash at any moment leaves a complete checkpoint behind.

:func:`save_sharded` writes a Distributed Checkpoint directory (every rank its shards, rank 0 ``meta.pt``),
:func:`save_full_file` one ordinary Lightning file; :func:`publish` gives a written checkpoint its final name.
What goes into them is :mod:`~fsdp_strategy.checkpoint.io`'s; how a save ends on every rank,
:mod:`~fsdp_strategy.checkpoint.saving`'s.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from fsdp_strategy._compat import FsspecWriter
from fsdp_strategy.checkpoint import storage
from fsdp_strategy.checkpoint.io import split_checkpoint
from fsdp_strategy.checkpoint.trainer_state import save_trainer_state

__all__ = [
    "PARTIAL_PREFIX",
    "RemoteShardWriter",
    "ShardWriter",
    "os_error_in",
    "publish",
    "remove_path",
    "replaced_data",
    "save_full_file",
    "save_sharded",
    "shard_writer",
    "staging_path",
]

PARTIAL_PREFIX = ".partial-"


def staging_path(path: Path | str, token: str) -> Path | str:
    """Where a checkpoint is written before it becomes visible as ``path``.

    Hidden, and without the word "last", so that neither a directory listing nor Lightning's
    ``ckpt_path="last"`` lookup ever takes a half-written checkpoint. On a URL, the prefix that keeps the
    shards for good, which the manifest written under ``path`` names (see :mod:`fsdp_strategy.checkpoint.storage`).
    """
    if storage.is_url(path):
        return storage.join(storage.parent(str(path)), f"{storage.DATA_PREFIX}{token}")
    return Path(path).parent / f"{PARTIAL_PREFIX}{token}"


def save_sharded(staging: Path | str, checkpoint: dict[str, Any], *, is_rank_zero: bool) -> None:
    """Every rank writes its shards into ``staging``; then rank 0 writes the trainer state to ``meta.pt``.

    When this returns on rank 0, every rank has written its shards: DCP's coordinator writes
    ``.metadata`` only after gathering all ranks' write results. A rank's failure is raised on every
    rank by DCP (as ``CheckpointException``), so rank 0 writes ``meta.pt`` only after all shards are in.
    """
    tensors, rest = split_checkpoint(checkpoint)
    dcp.save(tensors, storage_writer=shard_writer(staging))
    if is_rank_zero:
        save_trainer_state(staging, rest)


def shard_writer(staging: Path | str) -> FileSystemWriter:
    """DCP's writer for the staging location: a local directory, or a prefix behind a URL."""
    return RemoteShardWriter(staging) if storage.is_url(staging) else ShardWriter(staging)


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


def publish(staging: Path | str, path: Path | str) -> None:
    """Rank 0: gives a completely written checkpoint its final name, replacing an older one at that name.

    The older checkpoint is renamed aside first (``<name>.previous``), then removed once the new
    one is in place, so a crash at any moment leaves a complete checkpoint behind. On a URL the name
    is a manifest naming ``staging``, written in one go; the older checkpoint's files are removed after.
    """
    if storage.is_url(path):
        _publish_remote(str(staging), str(path))
        return
    path, staging = Path(path), Path(staging)
    previous = path.with_name(path.name + ".previous")
    if path.exists():
        remove_path(previous)
        os.rename(path, previous)
    os.rename(staging, path)
    remove_path(previous)


def _publish_remote(staging: str, path: str) -> None:
    try:
        older = storage.read_manifest(path)
    except FileNotFoundError:
        older = None
    storage.write_manifest(path, storage.name(staging))
    if older is not None:
        replaced = storage.data_url(path, older)
        if replaced.rstrip("/") != staging.rstrip("/"):
            storage.remove_data(replaced)


def replaced_data(path: Path | str) -> str | None:
    """The files of the sharded checkpoint that a new checkpoint at the URL ``path`` replaces (``None``: none)."""
    if not storage.is_url(path):
        return None
    try:
        older = storage.read_manifest(str(path))
    except FileNotFoundError:
        return None
    return None if older is None else storage.data_url(str(path), older)


def save_full_file(path: Path | str, checkpoint: dict[str, Any], token: str) -> None:
    """Rank 0: one ordinary Lightning checkpoint file, written aside and renamed into place.

    The directory is created as Lightning's ``TorchCheckpointIO`` creates it; a failed write removes
    its staging file and leaves any older checkpoint at ``path`` as it was. On a URL the file is written
    as DDP writes it there (Lightning's ``TorchCheckpointIO``: one upload, which replaces an older object
    at once); the files of a sharded checkpoint it replaces are removed after.
    """
    if storage.is_url(path):
        from lightning.fabric.plugins import (
            TorchCheckpointIO,  # what DDP writes files on URLs with
        )

        replaced = replaced_data(path)
        TorchCheckpointIO().save_checkpoint(checkpoint, str(path))
        if replaced is not None:
            storage.remove_data(replaced)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(staging_path(path, token))
    try:
        with open(staging, "wb") as file:  # a file object: torch derives an archive name from a path's stem
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        remove_path(staging)
        raise
    if path.is_dir():
        publish(staging, path)
    else:
        os.replace(staging, path)


def remove_path(path: Path | str) -> None:
    if storage.is_url(path):
        storage.remove(str(path))
        return
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
