"""The collectives of non-final micro-batches (``fsdp_strategy.sharding.accumulation``) on a real 1-rank gloo group:
a 2-D ``(dp_replicate, dp_shard)`` mesh of one rank runs FSDP2's hybrid path, all-reduce included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_strategy.sharding.accumulation import accumulation_micro_batch, writes_gradients
from fsdp_strategy.sharding.mesh import REPLICATE_DIM, SHARD_DIM, build_device_mesh
from testkit import full
from testkit.collectives import CollectiveCounter, counts_by_kind

MICRO_BATCHES = 4


def sharded_copy(model: nn.Module, mesh) -> nn.Module:
    copied = copy.deepcopy(model)
    for layer in copied:
        fully_shard(layer, mesh=mesh)
    return fully_shard(copied, mesh=mesh)


def accumulate(model: nn.Module, batches: list[torch.Tensor], *, sharded: bool, replicated: bool) -> list[bool]:
    """Runs the window; returns whether ``param.grad`` was set after each micro-batch."""
    written = []
    for index, batch in enumerate(batches):
        if index < len(batches) - 1:
            with accumulation_micro_batch(model, sharded=sharded, replicated=replicated):
                model(batch).square().sum().backward()
        else:
            model(batch).square().sum().backward()
        written.append(all(p.grad is not None for p in model.parameters()))
    return written


@pytest.fixture
def window() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), list(torch.randn(MICRO_BATCHES, 3, 8))


@pytest.mark.parametrize("sharded", [False, True])
def test_hybrid_accumulation_reaches_the_gradients_of_one_process(single_rank_group, window, sharded: bool) -> None:
    model, batches = window
    hybrid = sharded_copy(model, init_device_mesh("cpu", (1, 1), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM)))
    counter = CollectiveCounter()
    with counter:
        written = accumulate(hybrid, batches, sharded=sharded, replicated=True)
    for batch in batches:
        model(batch).square().sum().backward()
    for (name, expected), actual in zip(model.named_parameters(), hybrid.parameters()):
        torch.testing.assert_close(full(actual.grad), expected.grad, msg=name)
    # the partial sums stay inside FSDP2 until the last micro-batch all-reduces them: once per unit, as no_sync
    assert written == [
        writes_gradients(final=i == MICRO_BATCHES - 1, sharded=sharded, replicated=True) for i in range(4)
    ]
    assert written == [False, False, False, True]
    # one all-reduce per unit per window, as no_sync (torch < 2.13 also reduce-scatters a single shard; later ones copy)
    assert counts_by_kind(counter.records)["all_reduce"] == len(model)


def test_without_replicas_each_reduce_scatter_writes_the_gradients(single_rank_group, window) -> None:
    model, batches = window
    sharded = sharded_copy(model, build_device_mesh("cpu", 1, 1))
    written = accumulate(sharded, batches, sharded=True, replicated=False)
    assert written == [True] * MICRO_BATCHES
    assert written == [writes_gradients(final=False, sharded=True, replicated=False)] * MICRO_BATCHES


def test_a_module_that_is_not_sharded_is_left_alone(window) -> None:
    model, batches = window
    assert accumulate(model, batches, sharded=True, replicated=True) == [True] * MICRO_BATCHES
