"""Memory of one rank: the process's resident set size (now, at its peak, its peak reset) and CUDA's
peak allocated and reserved bytes. The model state a rank holds is counted by :mod:`fsdp_strategy.sharding.state_bytes`."""

from __future__ import annotations

import math
import os
import resource
import sys

import torch

__all__ = ["current_rss_bytes", "peak_memory", "peak_rss_bytes", "reset_peak_rss", "reset_peaks"]


def current_rss_bytes() -> int | None:
    """The resident set size of this process now, or ``None`` where neither psutil nor /proc has it."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.Process().memory_info().rss)
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def reset_peak_rss() -> bool:
    """Starts the process's peak resident set size afresh, as CUDA's peak is reset when fit starts
    (Linux only; elsewhere the peak stays the process's lifetime peak). Returns whether it did."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # 5: reset the peak RSS (VmHWM)
        return True
    except OSError:
        return False


def reset_peaks(device: torch.device) -> None:
    """Starts the peaks :func:`peak_memory` reads afresh: CUDA's on a CUDA device, and the peak RSS."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak_rss()


def peak_rss_bytes() -> int:
    """The largest resident set size of this process since it started, or since :func:`reset_peak_rss`."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def peak_memory(device: torch.device, rss_at_start: int | None = None) -> dict[str, float]:
    """Peak host memory (and peak CUDA memory on a CUDA device) in bytes; NaN where not measurable."""
    # The kernel updates VmHWM from per-thread RSS counters that may lag by a few pages, so right after a reset it
    # can read below the RSS of that moment; the peak since the start is at least the RSS then and now.
    peak_rss = max(peak_rss_bytes(), rss_at_start or 0, current_rss_bytes() or 0)
    memory = {
        "peak_rss_bytes": float(peak_rss),
        "rss_growth_bytes": math.nan if rss_at_start is None else float(peak_rss - rss_at_start),
        "peak_allocated_bytes": math.nan,
        "peak_reserved_bytes": math.nan,
    }
    if device.type == "cuda":
        memory["peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated(device))
        memory["peak_reserved_bytes"] = float(torch.cuda.max_memory_reserved(device))
    return memory
