"""Staging entries: the hidden names a checkpoint is written under before it is put in place, and the removal of
those that crashed runs left behind.

A staging entry is named after its writer (``.partial-<host>-<pid>-<id>`` locally, ``.shards-<host>-<pid>-<id>``
on a URL), so that the staging left by a crashed run can be told from one that another job is writing right now.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import socket
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from fsdp_strategy.checkpoint import storage, writing
from fsdp_strategy.checkpoint.location import Location, location_of

__all__ = ["remove_stale_staging", "staging_token"]

_PROCESS_START = time.time()


def staging_token() -> str:
    """``<host>-<pid>-<id>``: the machine (hashed: hex digits only, so the name never holds "last") and
    process that write the staging entry, then a random id."""
    return f"{_host_id()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _host_id() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def remove_stale_staging(directory: Path | str) -> list[Path | str]:
    """Removes the staging entries in ``directory`` that crashed runs left; warns about those it cannot judge.

    An entry is removed when its writer was a process of this machine that no longer runs and it
    was last changed before this process started, so that a save in progress (of this job or of
    another one writing into the same directory) is never touched. Entries written on another
    machine, or named by an older version, are kept and named in a warning if they are older than
    this process. On a URL the entries are the shard prefixes that no manifest names (see
    :mod:`fsdp_strategy.checkpoint.storage`). Returns the removed entries; never raises.
    """
    where = location_of(directory)
    if where.remote:
        return _remove_stale_remote(where)
    removed: list[Path | str] = []
    unknown = []
    try:
        entries = [e for e in Path(where.value).iterdir() if e.name.startswith(writing.PARTIAL_PREFIX)]
    except OSError:
        return []
    for entry in entries:
        try:
            if _last_change(entry) >= _PROCESS_START:
                continue
            owner = _owner(entry.name)
            if owner is None or owner[0] != _host_id():
                unknown.append(entry)
            elif not _process_runs(owner[1]):
                writing.remove_path(entry)
                removed.append(entry)
        except FileNotFoundError:  # removed meanwhile, e.g. by the job that wrote it
            continue
        except OSError as error:
            warnings.warn(
                f"Could not remove the staging entry '{entry}' that an earlier save left: {error}.", stacklevel=2
            )
    _warn_unknown(where, [e.name for e in unknown])
    return removed


def _warn_unknown(directory: Location, names: list[str]) -> None:
    if names:
        shown = ", ".join(f"'{name}'" for name in sorted(names))
        warnings.warn(
            f"'{directory}' holds staging entries of checkpoint saves that did not finish: {shown}. They were"
            " written on another machine or by an older version, so they are kept in case their job is still"
            " saving; delete them once no job writes into this directory.",
            stacklevel=3,
        )


def _remove_stale_remote(directory: Location) -> list[Path | str]:
    """The shard prefixes in ``directory`` that no manifest names, whose writer was a process of this
    machine that no longer runs, unchanged since before this process started."""
    try:
        fs, _ = directory.filesystem()
        entries = directory.entries()
    except (OSError, ValueError):
        return []
    names = {posixpath.basename(e["name"].rstrip("/")): e for e in entries}
    staged = [name for name in names if name.startswith(storage.DATA_PREFIX)]
    if not staged:
        return []
    referenced = set()
    for name, entry in names.items():
        if entry.get("type") == "file" and not name.startswith("."):
            try:
                manifest = storage.read_manifest(directory.join(name))
            except (OSError, ValueError):
                continue
            if manifest is not None:
                referenced.add(manifest.get("data"))
    removed: list[Path | str] = []
    unknown = []
    for name in staged:
        if name in referenced:
            continue
        prefix = directory.join(name)
        url = str(prefix)
        try:
            stamps = [
                info.get("LastModified") or info.get("mtime") or info.get("created")
                for info in fs.find(prefix.filesystem()[1], detail=True).values()
            ]
            newest = max((_timestamp(stamp) for stamp in stamps if stamp is not None), default=0.0)
            if newest >= _PROCESS_START:
                continue
            owner = _owner(name)
            if owner is None or owner[0] != _host_id():
                unknown.append(name)
            elif not _process_runs(owner[1]):
                prefix.remove()
                removed.append(url)
        except (OSError, ValueError) as error:
            warnings.warn(
                f"Could not remove the staging entry '{url}' that an earlier save left: {error}.", stacklevel=2
            )
    _warn_unknown(directory, unknown)
    return removed


def _timestamp(stamp: Any) -> float:
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def _owner(name: str) -> tuple[str, int] | None:
    kind = next((p for p in (writing.PARTIAL_PREFIX, storage.DATA_PREFIX) if name.startswith(p)), None)
    if kind is None:
        return None
    parts = name[len(kind) :].split("-")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def _last_change(entry: Path) -> float:
    """The latest modification time of the entry and, for a directory, of the files in it."""
    times = [entry.lstat().st_mtime]
    if entry.is_dir() and not entry.is_symlink():
        times += [child.lstat().st_mtime for child in entry.iterdir()]
    return max(times)


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
