"""The distributed Adafactor steps against the optimizers' own on whole parameters, without Lightning, on 4 ranks.

One launch runs every layout: 1 rank (a mesh of each rank alone), 2 ranks (two independent pairs), 4 ranks, and a
2x2 hybrid mesh ``(Replicate, Shard(0))``. Each run ``fully_shard``s a tiny module of uneven row counts (some ranks
hold no rows) and steps it 5 times against the original optimizer on a whole copy in the same process, both given
the same whole gradients (the sharded module its rows of them). ``resume`` runs 3 steps on 2 ranks, loads the full
state (whole tensors, as a full checkpoint holds it) into the same module sharded on 4 ranks, and runs 2 more. Rank 0
writes, per run, the largest relative difference of the parameters and of every state entry over all ranks, and
each step's collectives (kind -> count).
"""

from __future__ import annotations

import argparse
import copy
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers.optimization import Adafactor as HFAdafactor

from fsdp_strategy.checkpoint.optimizer_state import full_state, load_full_state
from fsdp_strategy.optim import adafactor
from testkit.collectives import CollectiveCounter

OPTIMIZERS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "torch": (torch.optim.Adafactor, adafactor.torch_step, {}),
    "torch_options": (
        torch.optim.Adafactor,
        adafactor.torch_step,
        {"lr": torch.tensor(0.05), "weight_decay": 0.1, "maximize": True, "beta2_decay": -0.5},
    ),
    "hf": (HFAdafactor, adafactor.transformers_step, {}),
    "hf_warmup": (HFAdafactor, adafactor.transformers_step, {"warmup_init": True}),
    "hf_options": (
        HFAdafactor,
        adafactor.transformers_step,
        {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "weight_decay": 0.1, "clip_threshold": 0.5},
    ),
}


class Uneven(nn.Module):
    """Row counts 7, 5, 1, 6, 5 and 9: on 4 ranks each layer leaves some rank fewer rows or none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 7)
        self.second = nn.Linear(7, 5)
        self.head = nn.Linear(5, 1)  # one row: its column statistics have the parameter's shape
        self.conv = nn.Conv2d(2, 6, 3)
        self.cube = nn.Parameter(torch.randn(5, 3, 4))
        self.scale = nn.Parameter(torch.randn(9))


def _meshes() -> dict[str, Any]:
    return {
        "1": init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))["shard"],
        "2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))["shard"],
        "4": init_device_mesh("cpu", (4,), mesh_dim_names=("shard",)),
        "2x2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
    }


def _optimizer(make: Any, model: nn.Module, options: dict[str, Any]) -> Any:
    params = list(model.parameters())
    return make([{"params": params[:5]}, {"params": params[5:]}], **options)  # two groups, batched together


def _step(plain: nn.Module, sharded: nn.Module, reference: Any, distributed: Any, step: Any, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    for p, s in zip(plain.parameters(), sharded.parameters()):
        p.grad = torch.randn(p.shape, generator=generator)
        s.grad = distribute_tensor(p.grad.clone(), s.device_mesh, s.placements, src_data_rank=None)
    reference.step()
    with CollectiveCounter() as counter:
        step(distributed)
    return dict(Counter(c.kind for c in counter.records))


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _relative(got: Any, expected: Any) -> float:
    got, expected = torch.as_tensor(_whole(got)).double(), torch.as_tensor(expected).double()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def _difference(plain: nn.Module, sharded: nn.Module, reference: Any, distributed: Any) -> float:
    """The largest relative difference over the parameters and every state entry, over all ranks."""
    worst = 0.0
    for p, s in zip(plain.parameters(), sharded.parameters()):
        worst = max(worst, _relative(s, p))
        expected, got = reference.state[p], distributed.state[s]
        assert got.keys() == expected.keys(), (got.keys(), expected.keys())
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                worst = max(worst, _relative(got[key], value))
            else:
                assert got[key] == value, (key, got[key], value)
    total = torch.tensor(worst, dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return total.item()


def _sharded(model: nn.Module, mesh: Any) -> nn.Module:
    model = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    return model


def run(name: str, layout: str, meshes: dict[str, Any]) -> dict[str, Any]:
    make, step, options = OPTIMIZERS[name]
    plain = Uneven()
    sharded = _sharded(plain, meshes[layout])
    reference, distributed = _optimizer(make, plain, options), _optimizer(make, sharded, options)
    counts = [_step(plain, sharded, reference, distributed, step, seed) for seed in range(5)]
    return {"difference": _difference(plain, sharded, reference, distributed), "collectives": counts}


def resume(name: str, meshes: dict[str, Any]) -> dict[str, Any]:
    """3 steps on 2 ranks, the full state loaded on 4 ranks (entries of the parameter's shape sharded, the others
    whole), 2 more steps."""
    make, step, options = OPTIMIZERS[name]
    plain = Uneven()
    sharded = _sharded(plain, meshes["2"])
    reference, distributed = _optimizer(make, plain, options), _optimizer(make, sharded, options)
    counts = [_step(plain, sharded, reference, distributed, step, seed) for seed in range(3)]
    saved = full_state(distributed, keep=True)
    resumed = Uneven()
    with torch.no_grad():
        for target, source in zip(resumed.parameters(), sharded.parameters()):
            target.copy_(source.full_tensor())
    resumed = _sharded(resumed, meshes["4"])
    distributed = _optimizer(make, resumed, options)
    load_full_state(distributed, saved)
    counts += [_step(plain, resumed, reference, distributed, step, seed) for seed in range(3, 5)]
    return {"difference": _difference(plain, resumed, reference, distributed), "collectives": counts}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    meshes = _meshes()
    results = {f"{name}/{layout}": run(name, layout, meshes) for name in OPTIMIZERS for layout in meshes}
    results.update({f"{name}/resume_2_to_4": resume(name, meshes) for name in ("torch", "hf_options")})
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
