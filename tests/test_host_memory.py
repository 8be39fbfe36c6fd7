"""``host_memory``: glibc's free heap pages handed back to the system, measured in this process's resident set."""

from __future__ import annotations

import os
import sys

import lightning as L
import pytest
import torch

from fsdp_strategy import FSDP2Strategy, host_memory
from fsdp_strategy.monitor.memory import current_rss_bytes
from testkit.models import TinyLM, token_loader

MiB = 2**20

on_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None,
    reason="glibc's malloc with its dynamic mmap threshold",
)


def heap_with_holes() -> list[torch.Tensor]:
    """32 heap blocks of 8 MiB, every other one freed: 128 MiB of holes that stay resident until released."""
    # Freeing a 16 MiB block raises the mmap threshold to its size: smaller blocks now come from the heap, as
    # FSDP's per-step buffers do after its first step.
    torch.ones(16 * MiB, dtype=torch.uint8)
    blocks = [torch.ones(8 * MiB, dtype=torch.uint8) for _ in range(32)]
    stats = host_memory.heap_stats()
    assert stats is not None and stats.heap_bytes >= 32 * 8 * MiB  # they are heap blocks, not mappings
    return blocks[0::2]


@on_glibc
def test_freed_heap_memory_is_resident_until_released():
    assert host_memory.supported()
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


class Holes(L.Callback):
    """Leaves 128 MiB of freed heap memory before the strategy's setup (where it shards the model) and before
    the optimizer step; measures RSS right then and after each."""

    def __init__(self) -> None:
        self.pinned: list[torch.Tensor] = []
        self.rss: list[int] = []

    def setup(self, trainer, pl_module, stage):
        self.pinned = heap_with_holes()
        self.rss.append(current_rss_bytes())

    def on_fit_start(self, trainer, pl_module):
        self.rss.append(current_rss_bytes())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.pinned = heap_with_holes()
        self.rss.append(current_rss_bytes())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rss.append(current_rss_bytes())


@on_glibc
@pytest.mark.parametrize(("mode", "handed_back"), [("release", True), ("keep", False)])
def test_the_strategy_hands_freed_memory_back_after_sharding_and_each_optimizer_step(
    trainer_env, tmp_path, mode, handed_back
):
    probe = Holes()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(host_memory=mode),
        max_steps=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    trainer.fit(TinyLM(), token_loader(batch_size=4, samples=8))
    before_setup, after_setup, before_step, after_step = probe.rss
    assert (before_setup - after_setup >= 100 * MiB) is handed_back
    assert (before_step - after_step >= 100 * MiB) is handed_back
