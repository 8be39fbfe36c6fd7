"""A disk that fills up or stalls, injected into a worker process: files opened for writing under a
directory go through it once it is armed.

``room``: the bytes that this process may write into them after ``arm()``; the write that would pass
it raises ``OSError(ENOSPC)``, as a full disk does. ``gate``: a ``threading.Event`` that every write
waits for (a slow disk, released by the test).

Installed over ``open`` (``torch.save`` to a file object, ``meta.pt``) and ``io.open`` (which pathlib,
and so Distributed Checkpoint's writer, calls), so the code under test runs unchanged.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import threading
from pathlib import Path
from typing import Any


class Disk:
    def __init__(self, directory: Path, *, room: int | None = None, gate: threading.Event | None = None) -> None:
        self.directory = os.path.realpath(directory)
        self.room, self.gate = room, gate
        self.armed = False
        self.written = 0
        self._real_open: Any = None

    def install(self) -> Disk:
        real_open = self._real_open = io.open

        def fault_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            stream = real_open(file, mode, *args, **kwargs)
            if self.armed and _writes(mode) and isinstance(file, (str, os.PathLike)) and self._inside(file):
                return _FaultyFile(stream, self)
            return stream

        builtins.open = io.open = fault_open
        return self

    def uninstall(self) -> None:
        builtins.open = io.open = self._real_open

    def arm(self) -> None:
        self.armed, self.written = True, 0

    def disarm(self) -> None:
        self.armed = False

    def _inside(self, file: Any) -> bool:
        return os.path.realpath(file).startswith(self.directory + os.sep)

    def take(self, count: int) -> None:
        if self.gate is not None:
            self.gate.wait()
        if self.room is not None and self.written + count > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += count


def _writes(mode: str) -> bool:
    return any(flag in mode for flag in "wax+")


class _FaultyFile:
    """The real file object, except that ``write`` goes through the disk's faults first."""

    def __init__(self, stream: Any, disk: Disk) -> None:
        self._stream, self._disk = stream, disk

    def write(self, data: Any) -> int:
        self._disk.take(memoryview(data).nbytes)
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stream.close()
