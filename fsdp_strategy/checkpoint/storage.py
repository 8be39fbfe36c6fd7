"""The files of a checkpoint wherever it lives (a :class:`~fsdp_strategy.checkpoint.location.Location`), and the
manifests that name sharded checkpoints on URLs.

A local path (``file://`` URLs included) keeps the directory layout and the rename into place of
:mod:`fsdp_strategy.checkpoint.writing`. Object stores have no atomic rename, and a prefix of objects is
visible to a listing as soon as its first object is written, so a sharded checkpoint on a URL is
published differently:

- its shards and ``meta.pt`` are written under a hidden prefix of their own next to it,
  ``.shards-<host>-<pid>-<id>/`` (the DCP layout, as a local checkpoint directory);
- then rank 0 writes the checkpoint's own name as one small object, the *manifest*: a JSON document
  naming that prefix. Writing one object is atomic on every object store, so the name appears only
  when the checkpoint is complete, and replacing an older checkpoint of the same name (``last.ckpt``)
  swaps the manifest in one write: a crash at any moment leaves a complete checkpoint under the name;
- removing a checkpoint removes its manifest first, then its prefix.

Listings, ``fs.exists`` and modification times of the name therefore behave as for DDP's single files
on the same store, and every reader (:func:`checkpoint_files`) goes through the manifest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from fsdp_strategy._compat import FsspecReader
from fsdp_strategy.checkpoint.errors import damaged
from fsdp_strategy.checkpoint.location import Location, filesystem, is_url, location_of

__all__ = [
    "DATA_PREFIX",
    "CheckpointFiles",
    "checkpoint_files",
    "data_url",
    "files_at",
    "filesystem",
    "is_url",
    "join",
    "location",
    "published_data",
    "read_checkpoint_file",
    "read_manifest",
    "remove",
    "remove_data",
    "write_manifest",
]

DATA_PREFIX = ".shards-"
MANIFEST_FORMAT = "fsdp_strategy/sharded-checkpoint"
_MANIFEST_MAX_BYTES = 1 << 16


def location(path: Any) -> Path | str:
    """A checkpoint location as messages name it: a URL as a string, a local path as a ``Path``."""
    return location_of(path).value


def join(url: str, name: str) -> str:
    return str(location_of(url).join(name))


# --- manifests ------------------------------------------------------------------------------------


def write_manifest(url: Any, data_name: str) -> None:
    """Gives the sharded checkpoint under the prefix ``data_name`` (next to ``url``) the name ``url``: one write."""
    document = {"format": MANIFEST_FORMAT, "version": 1, "data": data_name}
    location_of(url).write_bytes(json.dumps(document).encode())


def read_manifest(url: Any) -> dict[str, Any] | None:
    """The manifest at ``url``; ``None`` if ``url`` is another object (a single-file checkpoint).

    Raises ``FileNotFoundError`` if nothing is there.
    """
    where = location_of(url)
    fs, path = where.filesystem()
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"Checkpoint '{where}' does not exist.") from None
    if info.get("type") != "file" or (info.get("size") or 0) > _MANIFEST_MAX_BYTES:
        return None
    data = fs.cat_file(path)
    if not data.lstrip().startswith(b"{"):
        return None
    try:
        document = json.loads(data)
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
        return None
    return document


def published_data(url: Any) -> Location | None:
    """The shard prefix that the manifest at ``url`` names; ``None`` where there is no manifest (or nothing)."""
    try:
        manifest = read_manifest(url)
    except FileNotFoundError:
        return None
    return None if manifest is None else location_of(data_url(url, manifest))


def data_url(url: Any, manifest: dict[str, Any]) -> str:
    """Where the files of the checkpoint ``url`` are: the prefix its manifest names, next to it."""
    where = location_of(url)
    data = manifest.get("data")
    if not isinstance(data, str) or not data.startswith(DATA_PREFIX) or "/" in data:
        raise damaged(str(where), where.name, f"its manifest names no shard prefix of this checkpoint ({data!r}).")
    return str(where.parent.join(data))


def remove(path: Any) -> None:
    """Removes the checkpoint at ``path``: a manifest first (the name disappears at once), then the files it names."""
    where = location_of(path)
    manifest = read_manifest(where) if where.is_file() else None
    where.remove()  # nothing if nothing is there
    if manifest is not None:
        remove_data(data_url(where, manifest))


def remove_data(url: Any) -> None:
    location_of(url).remove()


# --- reading the files of a sharded checkpoint ----------------------------------------------------


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one sharded checkpoint: a local directory, or the prefix that a remote manifest names.

    ``name`` is how messages name the checkpoint (the path or URL the user gave); ``data`` is where its files
    are, which DCP's readers open.
    """

    data: Location
    name: Path | str

    @property
    def fs(self) -> Any:
        return self.data.filesystem()[0]

    @property
    def root(self) -> str:
        return self.data.filesystem()[1]

    @property
    def source(self) -> Path | str:
        return self.data.value

    def path(self, relative: str) -> str:
        return str(self.data.join(relative))

    def is_dir(self) -> bool:
        return self.data.is_dir()

    def is_file(self, relative: str) -> bool:
        return self.data.join(relative).is_file()

    def exists(self, relative: str) -> bool:
        return self.data.join(relative).exists()

    def size(self, relative: str) -> int:
        """Raises ``FileNotFoundError`` for a missing file."""
        fs, path = self.data.join(relative).filesystem()
        return int(fs.size(path))

    def read_bytes(self, relative: str) -> bytes:
        return self.data.join(relative).read_bytes()

    def read_range(self, relative: str, offset: int, length: int) -> bytes:
        fs, path = self.data.join(relative).filesystem()
        return fs.cat_file(path, start=offset, end=offset + length)

    def open(self, relative: str) -> Any:
        return self.data.join(relative).open("rb")

    def names(self) -> list[str]:
        return self.data.names()

    def readable(self, relative: str) -> bool:
        return self.data.join(relative).readable()

    def reader(self) -> Any:
        """DCP's storage reader for these files."""
        return FsspecReader(self.source) if self.data.remote else FileSystemReader(self.source)


def files_at(source: Any, *, name: Path | str) -> CheckpointFiles:
    """The :class:`CheckpointFiles` whose ``source`` (a local directory or a shard prefix's URL) is given."""
    return CheckpointFiles(location_of(source), name)


def checkpoint_files(path: Any) -> CheckpointFiles:
    """The files of the sharded checkpoint at ``path``: the directory itself, or (a URL) what its manifest names.

    Raises ``FileNotFoundError`` for a URL where nothing is, ``ValueError`` for a URL that is another
    object (a single-file checkpoint).
    """
    if isinstance(path, CheckpointFiles):
        return path
    where = location_of(path)
    if not where.remote:
        return CheckpointFiles(where, where.value)
    manifest = read_manifest(where)
    if manifest is None:
        raise ValueError(
            f"Checkpoint '{where}' is a single file, not a sharded checkpoint (its name holds no manifest)."
        )
    return CheckpointFiles(location_of(data_url(where, manifest)), where.value)


def read_checkpoint_file(checkpoint: Any, name: str) -> bytes:
    """The bytes of the file ``name`` of a checkpoint directory (a path, a URL or its
    :class:`~fsdp_strategy.checkpoint.storage.CheckpointFiles`); a missing, unreadable or empty one is damaged."""
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
