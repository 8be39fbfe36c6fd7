"""Where checkpoints live: a local path, or an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

A local path (``file://`` URLs included) keeps the directory layout and the rename into place of
:mod:`fsdp_strategy.checkpoint.io`. Object stores have no atomic rename, and a prefix of objects is
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
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from fsdp_strategy._compat import FsspecReader
from fsdp_strategy.checkpoint.errors import damaged

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
    "modified",
    "name",
    "parent",
    "read_checkpoint_file",
    "read_manifest",
    "remove",
    "write_manifest",
]

DATA_PREFIX = ".shards-"
MANIFEST_FORMAT = "fsdp_strategy/sharded-checkpoint"
_MANIFEST_MAX_BYTES = 1 << 16
_LOCAL_PROTOCOLS = ("file", "local")


def _protocol(path: Any) -> str | None:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    head, separator, _ = text.partition("://")
    return head if separator and head and "/" not in head else None


def is_url(path: Any) -> bool:
    """A URL of a filesystem other than the local one (``s3://b/x``; not ``/x``, ``file:///x``).

    A ``pathlib.Path`` is never one: ``Path("s3://b/x")`` has already collapsed into ``s3:/b/x``.
    """
    if isinstance(path, Path):
        return False
    protocol = _protocol(path)
    return protocol is not None and protocol not in _LOCAL_PROTOCOLS


def location(path: Any) -> Path | str:
    """A checkpoint location as the package handles it: a URL as a string, a local path as a ``Path``."""
    if is_url(path):
        return str(path)
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if _protocol(text) in _LOCAL_PROTOCOLS:
        text = text.partition("://")[2]
    return Path(text)


def filesystem(url: str) -> tuple[Any, str]:
    """``(fs, path)`` of a URL, as Lightning and DCP resolve it (``fsspec.core.url_to_fs``)."""
    from fsspec.core import url_to_fs

    try:
        return url_to_fs(url)
    except (ImportError, ValueError) as error:
        protocol = _protocol(url)
        raise ValueError(
            f"Cannot open checkpoint location '{url}': fsspec has no working filesystem for '{protocol}://'"
            f" ({error}). For S3 install the extra: pip install 'fsdp-strategy[s3]' (s3fs); for other stores"
            " the fsspec implementation they name (gcsfs, adlfs, ...)."
        ) from error


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def parent(url: str) -> str:
    protocol, _, rest = url.partition("://")
    return f"{protocol}://{posixpath.dirname(rest.rstrip('/'))}"


def name(url: str) -> str:
    return posixpath.basename(url.rstrip("/"))


# --- manifests ------------------------------------------------------------------------------------


def write_manifest(url: str, data_name: str) -> None:
    """Gives the sharded checkpoint under the prefix ``data_name`` (next to ``url``) the name ``url``: one write."""
    fs, path = filesystem(url)
    document = {"format": MANIFEST_FORMAT, "version": 1, "data": data_name}
    fs.pipe(path, json.dumps(document).encode())


def read_manifest(url: str) -> dict[str, Any] | None:
    """The manifest at ``url``; ``None`` if ``url`` is another object (a single-file checkpoint).

    Raises ``FileNotFoundError`` if nothing is there.
    """
    fs, path = filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"Checkpoint '{url}' does not exist.") from None
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


def data_url(url: str, manifest: dict[str, Any]) -> str:
    """Where the files of the checkpoint ``url`` are: the prefix its manifest names, next to it."""
    data = manifest.get("data")
    if not isinstance(data, str) or not data.startswith(DATA_PREFIX) or "/" in data:
        raise damaged(url, name(url), f"its manifest names no shard prefix of this checkpoint ({data!r}).")
    return join(parent(url), data)


def remove(url: str) -> None:
    """Removes the checkpoint ``url``: a manifest first (the name disappears at once), then its files."""
    fs, path = filesystem(url)
    if not fs.exists(path):
        return
    manifest = read_manifest(url) if fs.isfile(path) else None
    fs.rm(path, recursive=True)
    if manifest is not None:
        remove_data(data_url(url, manifest))


def remove_data(url: str) -> None:
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    fs.invalidate_cache()


def modified(url: str) -> float:
    """The time the checkpoint at ``url`` was published (its manifest or file written), in seconds."""
    fs, path = filesystem(url)
    stamp = fs.modified(path)
    return stamp.timestamp()


# --- reading the files of a sharded checkpoint ----------------------------------------------------


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one sharded checkpoint: a local directory, or the prefix that a remote manifest names.

    ``name`` is how messages name the checkpoint (the path or URL the user gave); ``source`` is what
    DCP's readers open (a local path, or the prefix's URL).
    """

    fs: Any
    root: str
    name: Path | str
    source: Path | str

    @property
    def remote(self) -> bool:
        return isinstance(self.source, str)

    def path(self, relative: str) -> str:
        return (
            self.fs.sep.join([self.root.rstrip(self.fs.sep), relative])
            if self.remote
            else str(Path(self.root) / relative)
        )

    def is_dir(self) -> bool:
        return self.fs.isdir(self.root)

    def is_file(self, relative: str) -> bool:
        return self.fs.isfile(self.path(relative))

    def exists(self, relative: str) -> bool:
        return self.fs.exists(self.path(relative))

    def size(self, relative: str) -> int:
        """Raises ``FileNotFoundError`` for a missing file."""
        return int(self.fs.size(self.path(relative)))

    def read_bytes(self, relative: str) -> bytes:
        return self.fs.cat_file(self.path(relative))

    def read_range(self, relative: str, offset: int, length: int) -> bytes:
        return self.fs.cat_file(self.path(relative), start=offset, end=offset + length)

    def names(self) -> list[str]:
        return [posixpath.basename(entry.rstrip("/")) for entry in self.fs.ls(self.root, detail=False)]

    def readable(self, relative: str) -> bool:
        return self.remote or os.access(self.path(relative), os.R_OK)

    def reader(self) -> Any:
        """DCP's storage reader for these files."""
        return FsspecReader(self.source) if self.remote else FileSystemReader(self.source)


def files_at(source: str, *, name: Path | str) -> CheckpointFiles:
    """The :class:`CheckpointFiles` whose ``source`` (a local directory or a shard prefix's URL) is given."""
    if not is_url(source):
        return checkpoint_files(Path(source))
    fs, root = filesystem(source)
    return CheckpointFiles(fs, root, name, source)


def checkpoint_files(path: Path | str | CheckpointFiles) -> CheckpointFiles:
    """The files of the sharded checkpoint at ``path``: the directory itself, or (a URL) what its manifest names.

    Raises ``FileNotFoundError`` for a URL where nothing is, ``ValueError`` for a URL that is another
    object (a single-file checkpoint).
    """
    if isinstance(path, CheckpointFiles):
        return path
    where = location(path)
    if isinstance(where, Path):
        from fsspec.implementations.local import LocalFileSystem

        return CheckpointFiles(LocalFileSystem(), str(where), where, where)
    manifest = read_manifest(where)
    if manifest is None:
        raise ValueError(
            f"Checkpoint '{where}' is a single file, not a sharded checkpoint (its name holds no manifest)."
        )
    data = data_url(where, manifest)
    fs, root = filesystem(data)
    return CheckpointFiles(fs, root, where, data)


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
