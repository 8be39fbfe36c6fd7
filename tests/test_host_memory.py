"""``host_memory``: glibc's free heap pages handed back to the system, measured in this process's resident set."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from fsdp_strategy import host_memory
from fsdp_strategy.monitor.memory import current_rss_bytes

MiB = 2**20

on_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None,
                              reason="glibc's malloc with its dynamic mmap threshold")


@on_glibc
def test_freed_heap_memory_is_resident_until_released():
    assert host_memory.supported()
    # Freeing a 16 MiB block raises the mmap threshold to its size: smaller blocks now come from the heap, as
    # FSDP's per-step buffers do after its first step.
    torch.ones(16 * MiB, dtype=torch.uint8)
    blocks = [torch.ones(8 * MiB, dtype=torch.uint8) for _ in range(32)]
    stats = host_memory.heap_stats()
    assert stats is not None and stats.heap_bytes >= 32 * 8 * MiB  # they are heap blocks, not mappings
    before_free = current_rss_bytes()
    pinned = blocks[0::2]  # every other block stays: what is freed is holes, not the top of the heap
    del blocks
    after_free = current_rss_bytes()
    assert before_free - after_free < 32 * MiB  # 128 MiB freed, but (almost all) still resident
    assert host_memory.release()
    assert after_free - current_rss_bytes() >= 100 * MiB
    assert all(int(block[-1]) == 1 for block in pinned)  # the blocks in use are untouched


def test_release_is_a_no_op_where_the_c_library_is_not_glibc(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    host_memory._libc.cache_clear()
    try:
        assert not host_memory.supported()
        assert host_memory.release() is False
        assert host_memory.heap_stats() is None
    finally:
        monkeypatch.undo()
        host_memory._libc.cache_clear()
