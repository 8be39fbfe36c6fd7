"""Modules built under ``deferred_init`` on several ranks, sharded, then materialized (``test_deferred.py``).

Every case is built with a seed of its own on each rank (no common seed, as DDP does not need one),
sharded with ``fully_shard`` on each mesh in ``--meshes`` (``flat``: one shard per rank; ``hybrid``:
replicate 2 x shard N/2), and materialized. Rank 0 writes to ``--out``, per mesh and case, every rank's
local shards and mesh coordinate, and the same module built eagerly with rank 0's seed.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_strategy.launch import rendezvous
from fsdp_strategy.sharding.deferred_init import (
    deferred_init,
    materialize,
    records_by_name,
)

CPU = torch.device("cpu")


class Rows(nn.Module):
    """Written row by row, without tensor operands: each rank replays its own rows (7 and 3 rows, uneven)."""

    def __init__(self) -> None:
        super().__init__()
        self.seven = nn.Parameter(torch.empty(7, 3))
        self.three = nn.Parameter(torch.empty(3, 2))
        with torch.no_grad():
            self.seven.fill_(1.0)
            self.seven[2:5].mul_(3.0)
            self.seven[6].zero_()
            self.seven.add_(0.5)
            self.three.fill_(2.0)
            self.three[1].fill_(-1.0)


class Exact(nn.Module):
    """Known values through writes that are not row by row: built in full, then sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.copied = nn.Parameter(torch.empty(7, 3))
        self.summed = nn.Parameter(torch.empty(3, 2))
        self.multiplied = nn.Parameter(torch.empty(7, 3))
        with torch.no_grad():
            self.copied.copy_(torch.arange(21.0).reshape(7, 3))
            self.copied[[1, 5]] = -1.0  # index_put_
            self.summed.copy_(torch.arange(6.0).reshape(3, 2)).cumsum_(0)
            self.multiplied.fill_(1.0).renorm_(2, 1, 1.0).addmm_(torch.ones(7, 2), torch.ones(2, 3))


class Random(nn.Module):
    """Random inits replayed by rows: each shard its own draw, replicas the same one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 64)
        self.normal = nn.Parameter(torch.empty(64, 16))
        nn.init.normal_(self.normal, std=0.02)


class PerRank(nn.Module):
    """Values drawn on each rank during construction: every rank must end up with rank 0's, as under DDP."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = nn.Parameter(torch.empty(7, 3))
        self.rotation = nn.Parameter(torch.empty(8, 8))
        with torch.no_grad():
            self.drawn.copy_(torch.randn(7, 3))
        nn.init.orthogonal_(self.rotation)


def head() -> nn.Module:
    """Built eagerly and added to a deferred body (as in configure_model): it keeps its values."""
    layer = nn.Linear(64, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(192.0).reshape(3, 64))
        layer.bias.fill_(0.25)
    return layer


def encoder() -> nn.Module:
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32), 2, enable_nested_tensor=False)


CASES = {"rows": Rows, "exact": Exact, "random": Random, "per_rank": PerRank, "mixed": None, "encoder": encoder}


def build(case: str, *, deferred: bool) -> nn.Module:
    if not deferred:
        return nn.Sequential(nn.Linear(16, 64), head()) if case == "mixed" else CASES[case]()
    with deferred_init(CPU):
        model = nn.Sequential(nn.Linear(16, 64)) if case == "mixed" else CASES[case]()
    return model.append(head()) if case == "mixed" else model


def run(case: str, mesh) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)
    model = build(case, deferred=True)
    records = records_by_name(model)
    for layer in getattr(model, "layers", []):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize(model, CPU, records)
    shards = {name: param.to_local().detach().clone() for name, param in model.named_parameters()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mesh.get_coordinate(), shards))
    if rank != 0:
        return {}
    torch.manual_seed(1000)
    eager = {name: param.detach().clone() for name, param in build(case, deferred=False).named_parameters()}
    return {"coordinates": [c for c, _ in gathered], "shards": [s for _, s in gathered], "eager": eager}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--meshes", default="flat")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rendezvous.finish_collectives_at_exit()  # gloo threads finish before Python does (docs/gloo_exit_abort.py)
    world = dist.get_world_size()
    results: dict = {}
    for kind in args.meshes.split(","):
        if kind == "hybrid":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        results[kind] = {case: run(case, mesh) for case in args.cases.split(",")}
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
