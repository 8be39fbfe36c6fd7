"""``fsdp_strategy.sharding.state_bytes``: the bytes of parameters, gradients and optimizer state, as this rank
holds them and whole, checked against counts worked out from shapes and dtypes."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from fsdp_strategy.sharding.state_bytes import (
    full_bytes,
    held_bytes,
    model_state_bytes,
    model_state_tensors,
)
from fsdp_strategy.sharding.unshard import full_state_bytes


def test_model_state_bytes_counts_params_grads_and_optimizer_state_once_per_tensor(mesh):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    sharded = copy.deepcopy(model)
    fully_shard(sharded, mesh=mesh)
    expected = {}
    for name, module in (("plain", model), ("sharded", sharded)):
        optimizer = torch.optim.AdamW(module.parameters())
        module(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        expected[name] = model_state_bytes(module, [optimizer])
    elements = (4 * 8 + 8) + (8 * 2 + 2)
    # parameters, gradients, exp_avg, exp_avg_sq in fp32, plus Adam's fp32 step counter per tensor
    assert expected["plain"] == 4 * elements * 4 + 4 * 4
    assert expected["sharded"] == expected["plain"]  # one rank: its shards are the whole tensors


def _half_of(full: torch.Tensor, mesh) -> DTensor:
    """Rank 0's half of ``full`` sharded over two ranks on dim 0, as a DTensor of ``full``'s global shape
    (on a one-rank mesh: only the shard's size matters here, and it is half the global one)."""
    half = full[: full.shape[0] // 2].clone()
    return DTensor.from_local(half, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def test_held_bytes_count_the_local_shard_and_full_bytes_the_global_shape(mesh):
    weight = nn.Parameter(_half_of(torch.zeros(6, 4), mesh))  # fp32: 96 bytes whole, 48 held
    bias = nn.Parameter(torch.zeros(4, dtype=torch.float64))  # not sharded: 32 bytes either way
    module = nn.Module()
    module.weight, module.bias, module.tied = weight, bias, weight
    weight.grad = _half_of(torch.zeros(6, 4), mesh)
    optimizer = torch.optim.SGD([weight, bias], lr=0.1)
    optimizer.state[weight] = {"step": torch.tensor(1.0), "momentum_buffer": _half_of(torch.zeros(6, 4), mesh)}

    assert held_bytes([weight, bias]) == 48 + 32 and full_bytes([weight, bias]) == 96 + 32
    # parameters (the tied one once), the weight's gradient, its momentum and a 4-byte step counter
    assert model_state_bytes(module, [optimizer]) == (48 + 32) + 48 + 48 + 4
    assert model_state_bytes(module, [optimizer], scalar_state=False) == (48 + 32) + 48 + 48
    assert full_bytes(model_state_tensors(module, [optimizer])) == (96 + 32) + 96 + 96 + 4
    # what gathering the module takes: whole parameters and optimizer state, no gradients
    assert full_state_bytes(module, [optimizer]) == (96 + 32) + 96 + 4
