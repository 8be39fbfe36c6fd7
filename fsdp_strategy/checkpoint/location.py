"""Where a checkpoint is: a local path, or an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...), decided once.

:func:`location_of` makes that decision for a path a user gave (``file://`` URLs are local paths), and the
:class:`Location` it returns carries every operation the checkpoint layer performs there, so no other module
tells a URL from a path again. It imports nothing of the package: options can check a location without
loading the checkpoint layer.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any

__all__ = ["LocalLocation", "Location", "RemoteLocation", "filesystem", "is_url", "location_of"]

_LOCAL_PROTOCOLS = ("file", "local")


def _protocol(path: Any) -> str | None:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    head, separator, _ = text.partition("://")
    return head if separator and head and "/" not in head else None


def is_url(path: Any) -> bool:
    """A URL of a filesystem other than the local one (``s3://b/x``; not ``/x``, ``file:///x``).

    A ``pathlib.Path`` is never one: ``Path("s3://b/x")`` has already collapsed into ``s3:/b/x``.
    """
    if isinstance(path, Location):
        return path.remote
    if isinstance(path, Path):
        return False
    protocol = _protocol(path)
    return protocol is not None and protocol not in _LOCAL_PROTOCOLS


def location_of(path: Any) -> Location:
    """The :class:`Location` of ``path`` (a path, a URL, or a ``Location`` already, returned as it is)."""
    if isinstance(path, Location):
        return path
    if is_url(path):
        return RemoteLocation(str(path))
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if _protocol(text) in _LOCAL_PROTOCOLS:
        text = text.partition("://")[2]
    return LocalLocation(Path(text))


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


class Location(ABC):
    """A file or folder of checkpoints, local or behind a URL; messages name it as the user gave it (``value``)."""

    remote: bool

    @property
    @abstractmethod
    def value(self) -> Path | str:
        """A local ``Path``, or the URL as a string: what errors and messages name."""

    @property
    @abstractmethod
    def parent(self) -> Location: ...

    @property
    @abstractmethod
    def name(self) -> str: ...

    @abstractmethod
    def join(self, name: str) -> Location: ...

    @abstractmethod
    def filesystem(self) -> tuple[Any, str]:
        """``(fs, path)``: the fsspec filesystem and the path on it."""

    @abstractmethod
    def makedirs(self) -> None:
        """Creates this folder and those above it, as far as the store has folders."""

    @abstractmethod
    def remove(self) -> None:
        """Removes the file or the folder with everything in it; nothing if there is none."""

    @abstractmethod
    def write_bytes(self, data: bytes) -> None:
        """Writes the file in one go: a reader sees the old contents or the new ones, never a part."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and type(other) is type(self) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def exists(self) -> bool:
        fs, path = self.filesystem()
        return fs.exists(path)

    def is_file(self) -> bool:
        fs, path = self.filesystem()
        return fs.isfile(path)

    def is_dir(self) -> bool:
        fs, path = self.filesystem()
        return fs.isdir(path)

    def entries(self) -> list[dict[str, Any]]:
        """The entries in this folder as they are now, as fsspec details them (``name``, ``type``, ``size``, times)."""
        fs, path = self.filesystem()
        fs.invalidate_cache()  # a cached listing would miss what other processes wrote since
        return fs.ls(path, detail=True)

    def names(self) -> list[str]:
        return [posixpath.basename(entry["name"].rstrip("/")) for entry in self.entries()]

    def open(self, mode: str = "rb") -> IO[Any]:
        fs, path = self.filesystem()
        return fs.open(path, mode)

    def read_bytes(self) -> bytes:
        fs, path = self.filesystem()
        return fs.cat_file(path)

    def modified(self) -> float:
        """When the file was last written, in seconds since the epoch."""
        fs, path = self.filesystem()
        return fs.modified(path).timestamp()

    def readable(self) -> bool:
        """Whether this process may read the file (an object store says so only when it is read)."""
        return True

    def free_bytes(self) -> int | None:
        """The space left for writing here; ``None`` where it is not known (object stores)."""
        return None


class LocalLocation(Location):
    remote = False

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def value(self) -> Path:
        return self.path

    @property
    def parent(self) -> LocalLocation:
        return LocalLocation(self.path.parent)

    @property
    def name(self) -> str:
        return self.path.name

    def join(self, name: str) -> LocalLocation:
        return LocalLocation(self.path / name)

    def filesystem(self) -> tuple[Any, str]:
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem(), str(self.path)

    def exists(self) -> bool:
        return self.path.exists()

    def is_file(self) -> bool:
        return self.path.is_file()

    def is_dir(self) -> bool:
        return self.path.is_dir()

    def names(self) -> list[str]:
        return [entry.name for entry in self.path.iterdir()]

    def open(self, mode: str = "rb") -> IO[Any]:
        return open(self.path, mode)

    def read_bytes(self) -> bytes:
        return self.path.read_bytes()

    def modified(self) -> float:
        return os.path.getmtime(self.path)

    def readable(self) -> bool:
        return os.access(self.path, os.R_OK)

    def free_bytes(self) -> int | None:
        for candidate in (self.path, *self.path.parents):  # the nearest folder that exists
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                continue
        return None

    def makedirs(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def rename(self, target: LocalLocation) -> None:
        os.rename(self.path, target.path)

    def remove(self) -> None:
        if self.path.is_dir() and not self.path.is_symlink():
            shutil.rmtree(self.path)
        elif self.path.exists() or self.path.is_symlink():
            self.path.unlink()

    def write_bytes(self, data: bytes) -> None:
        # Written aside and renamed: an interrupted write leaves no file under the name.
        self.parent.makedirs()
        partial = self.path.with_name(f"{self.path.name}.partial")
        with open(partial, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, self.path)


class RemoteLocation(Location):
    remote = True

    def __init__(self, url: str) -> None:
        self.url = url

    @property
    def value(self) -> str:
        return self.url

    @property
    def parent(self) -> RemoteLocation:
        protocol, _, rest = self.url.partition("://")
        return RemoteLocation(f"{protocol}://{posixpath.dirname(rest.rstrip('/'))}")

    @property
    def name(self) -> str:
        return posixpath.basename(self.url.rstrip("/"))

    def join(self, name: str) -> RemoteLocation:
        return RemoteLocation(self.url.rstrip("/") + "/" + name)

    def filesystem(self) -> tuple[Any, str]:
        return filesystem(self.url)

    def makedirs(self) -> None:
        return  # object stores have no folders: a prefix exists once an object is written under it

    def remove(self) -> None:
        fs, path = self.filesystem()
        if fs.exists(path):
            fs.rm(path, recursive=True)
        fs.invalidate_cache()

    def write_bytes(self, data: bytes) -> None:
        fs, path = self.filesystem()  # one object written in one request: atomic on every object store
        fs.pipe(path, data)
