"""Host memory: how much is available (``MemAvailable``), glibc's own count of the heap (``mallinfo2``), and
handing freed memory back to the system (``malloc_trim``); the glibc calls are no-ops on any other C library.

On CPU every tensor is a ``malloc`` block. glibc serves blocks below its mmap threshold from the heap, and that
threshold follows the largest mmapped block freed so far (up to 32 MiB), so after the first large free most of
FSDP's per-step buffers (gathered parameters, unsharded gradients, reduce-scatter buffers, optimizer
temporaries) come from the heap. Freed heap memory stays resident until the top of the heap is free, which the
model state allocated in between rarely lets happen: the process's resident set grows over the first steps while
its live tensors do not (docs/benchmarks.md). ``malloc_trim(0)`` hands every free page inside the heap back
(``madvise(MADV_DONTNEED)``) without moving anything, and costs a walk over the free lists.

Everything here goes through ``ctypes`` on the running process's own C library: nothing to install, and
:func:`supported` is ``False`` (every call a no-op returning ``False``/``None``) where that is not glibc (macOS,
Windows, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["HeapStats", "available", "heap_stats", "release", "supported"]


@dataclass(frozen=True)
class HeapStats:
    """glibc's ``mallinfo2()``: bytes in the heap (all arenas), free there, and in mmapped blocks."""

    heap_bytes: int  # arena: obtained with sbrk/arena mmap
    free_bytes: int  # fordblks: free chunks inside it (resident unless trimmed)
    mmapped_bytes: int  # hblkhd: blocks of their own mapping


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _ = libc.gnu_get_libc_version  # glibc only: musl has malloc_trim as a stub that does nothing useful
        _ = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def supported() -> bool:
    """Whether this process runs on glibc's malloc, so that :func:`release` can do something."""
    return _libc() is not None


def release() -> bool:
    """Hands the free pages of the heap back to the system (``malloc_trim(0)``). Returns whether any were."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def heap_stats() -> HeapStats | None:
    """The allocator's own figures (glibc 2.33 and later), or ``None`` elsewhere."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return HeapStats(heap_bytes=info.arena, free_bytes=info.fordblks, mmapped_bytes=info.hblkhd)


def available() -> int | None:
    """``MemAvailable`` of this host in bytes (Linux), ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None
