"""Module state across ranks (``fsdp_strategy.step.buffer_sync``) on a real 1-rank gloo group.

Collectives are counted with ``CommDebugMode``, which sees every c10d call. Values across ranks are
compared with DDP in ``integration_tests/test_dropin.py``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from fsdp_strategy.step.buffer_sync import (
    BufferSync,
    broadcast_tensors,
    check_sync_batchnorm,
    module_buffers,
    sync_module_states,
)
from testkit.dropin import RunningScale, TinyCNN, TinyMoE, image_loader, token_loader

BROADCAST = torch.ops.c10d.broadcast_


def broadcasts(action) -> int:  # type: ignore[no-untyped-def]
    with CommDebugMode() as comm:
        action()
    return comm.get_comm_counts()[BROADCAST]


def test_one_broadcast_per_dtype_and_values_copied_back(single_rank_group) -> None:
    tensors = [torch.arange(6.0).view(2, 3).t(), torch.ones(4), torch.tensor([3]), torch.arange(5)]
    before = [t.clone() for t in tensors]
    assert broadcasts(lambda: broadcast_tensors(tensors)) == 2  # float32 and int64
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_buckets_bound_the_message_size(single_rank_group) -> None:
    tensors = [torch.ones(256) for _ in range(4)]  # 1 KiB each
    assert broadcasts(lambda: broadcast_tensors(tensors, bucket_bytes=2048)) == 2
    assert broadcasts(lambda: broadcast_tensors(tensors, bucket_bytes=512)) == 4


def test_sharded_parameters_are_not_broadcast(mesh) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert broadcasts(lambda: sync_module_states(model)) == 2  # the parameters with the float buffers, the counter
    fully_shard(model, mesh=mesh)
    assert broadcasts(lambda: sync_module_states(model)) == 2  # the buffers only
    assert broadcasts(lambda: sync_module_states(nn.Linear(2, 2))) == 1


def test_buffers_ddp_was_told_to_ignore_stay_local(single_rank_group) -> None:
    model = nn.Sequential(nn.Linear(4, 4), RunningScale())
    model._ddp_params_and_buffers_to_ignore = ["1.running_abs"]
    assert module_buffers(model) == []


def test_buffer_sync_follows_ddp(single_rank_group) -> None:
    sync = BufferSync(nn.BatchNorm1d(3))
    assert broadcasts(sync.before_step) == 2  # DDP syncs before its first forward
    sync.after_step(gradient_sync=False)  # a no_sync micro-batch or a validation step
    assert broadcasts(sync.before_step) == 0
    sync.after_step(gradient_sync=True)
    assert broadcasts(sync.before_step) == 2


def test_no_collective_for_a_module_without_buffers(single_rank_group) -> None:
    sync = BufferSync(nn.Linear(3, 3))
    for _ in range(2):
        assert broadcasts(sync.before_step) == 0
        sync.after_step(gradient_sync=True)


def test_sync_batchnorm_on_the_cpu_fails_as_under_ddp() -> None:
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    with pytest.raises(ValueError, match="^SyncBatchNorm layers only work with GPU modules$"):
        check_sync_batchnorm(model, torch.device("cpu"))
    check_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), torch.device("cpu"))


class StepBroadcasts(L.Callback):
    """Counts the broadcasts of each training step (forward, backward and optimizer step)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.mode = CommDebugMode()
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.mode.__exit__(None, None, None)
        self.counts.append(self.mode.get_comm_counts()[BROADCAST])


def count_step_broadcasts(model: L.LightningModule, loader) -> list[int]:  # type: ignore[no-untyped-def]
    counter = StepBroadcasts()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="fsdp2",
        max_steps=3,
        limit_val_batches=0,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[counter],
    )
    trainer.fit(model, loader)
    return counter.counts


def test_training_steps_of_a_module_without_buffers_broadcast_nothing(trainer_env) -> None:
    assert count_step_broadcasts(TinyMoE(), token_loader("moe", rank=0, batch_size=2, batches=3)) == [0, 0, 0]
    trainer_env.fresh()
    # The same count sees the buffers of a module that has them: float32 statistics and int64 counters.
    assert count_step_broadcasts(TinyCNN(), image_loader(rank=0, batch_size=4, batches=3)) == [2, 2, 2]
