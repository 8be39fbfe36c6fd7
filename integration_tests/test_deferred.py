"""Deferred initialization (``init_module(empty_init=True)``) on 2 ranks, and on 4 ranks both flat and hybrid
(replicate 2 x shard 2), each rank with a seed of its own (``integration_tests/deferred_worker.py``).

Each rank's shard is compared with the rows ``fully_shard`` gives it (``torch.chunk``) of an eager build where
the values are deterministic; random values are compared by statistics with the eager build's, shard
against shard (different draws) and replica against replica (the same draw)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from integration_tests.conftest import launch


def expected_shard(full: torch.Tensor, coordinate: list[int], shards: int) -> torch.Tensor:
    """The rows of ``full`` that FSDP2 gives the rank at ``coordinate`` (its last mesh dim shards dim 0)."""
    chunks = full.chunk(shards)  # 3 rows in 4 shards: 3 chunks, the last rank holds no row
    return chunks[coordinate[-1]] if coordinate[-1] < len(chunks) else full[:0]


def assembled(result: dict, name: str) -> torch.Tensor:
    """The full parameter from the shards of the first replica."""
    shards = {c[-1]: s[name] for c, s in zip(result["coordinates"], result["shards"]) if all(i == 0 for i in c[:-1])}
    return torch.cat([shards[i] for i in sorted(shards)])


def check_exact(result: dict, names: list[str]) -> None:
    count = len({coordinate[-1] for coordinate in result["coordinates"]})
    for name in names:
        for coordinate, shards in zip(result["coordinates"], result["shards"]):
            expected = expected_shard(result["eager"][name], coordinate, count)
            assert torch.equal(shards[name], expected), (name, coordinate)


def check_random(result: dict, name: str) -> None:
    """Shard ranks drew different values, replicas the same, and the whole has the eager build's spread."""
    by_coordinate = {tuple(c): s[name] for c, s in zip(result["coordinates"], result["shards"])}
    for coordinate, shard in by_coordinate.items():
        replica0 = by_coordinate[(0,) * (len(coordinate) - 1) + coordinate[-1:]]
        assert torch.equal(shard, replica0), (name, coordinate)
        if coordinate[-1] > 0:
            first = by_coordinate[coordinate[:-1] + (0,)]
            assert not torch.allclose(shard, first[: len(shard)]), f"{name}: shards drawn from the same stream"
    values, eager = assembled(result, name), result["eager"][name]
    assert values.std().item() == pytest.approx(eager.std().item(), rel=max(0.1, 3 / math.sqrt(values.numel()))), name
    assert values.abs().max() <= eager.abs().max() * 1.25 + 1e-3, name


@pytest.mark.parametrize("nproc", [2, 4])
def test_shards_of_a_deferred_build_hold_the_eager_builds_rows(tmp_path: Path, nproc: int) -> None:
    meshes = ["flat", "hybrid"] if nproc == 4 else ["flat"]
    results = launch(["--meshes", ",".join(meshes)], tmp_path, nproc=nproc, module="integration_tests.deferred_worker")
    for mesh in meshes:
        cases = results[mesh]
        # Rows written by fills and scalar ops: each rank replays its own rows, 7 and 3 split unevenly
        # (4+3 on 2 ranks, 2+2+2+1 and 1+1+1+0 on 4, 4+3 and 2+1 per replica).
        check_exact(cases["rows"], ["seven", "three"])
        # index_put_, cumsum_, renorm_, addmm_ and copy_ of a known tensor: built in full, rows cut out.
        check_exact(cases["exact"], ["copied", "summed", "multiplied"])
        # Values each rank drew for itself during construction: rank 0's on every rank.
        check_exact(cases["per_rank"], ["drawn", "rotation"])
        rotation = assembled(cases["per_rank"], "rotation")
        assert torch.allclose(rotation @ rotation.T, torch.eye(8), atol=1e-5)
        # A head built eagerly next to a deferred body keeps its values.
        check_exact(cases["mixed"], ["1.weight", "1.bias"])
        check_random(cases["mixed"], "0.weight")
        for name in ("linear.weight", "linear.bias", "normal"):
            check_random(cases["random"], name)
        # nn.TransformerEncoder deep-copies its layer: every layer the same values, as eagerly.
        encoder = cases["encoder"]
        for shards in encoder["shards"]:
            for name, values in shards.items():
                if name.startswith("layers.0."):
                    assert torch.equal(values, shards[name.replace("layers.0.", "layers.1.")]), name
        check_exact(encoder, ["layers.0.self_attn.in_proj_bias", "layers.0.norm1.weight", "layers.1.norm2.bias"])
        for name in ("layers.0.self_attn.in_proj_weight", "layers.0.linear1.weight", "layers.1.linear2.weight"):
            check_random(encoder, name)
        assert assembled(encoder, "layers.0.linear1.weight").abs().max() <= 1 / math.sqrt(16)
