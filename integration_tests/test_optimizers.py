"""Optimizers that read more than each element, and training steps that read whole parameters, against DDP.

Two launches of ``integration_tests/optimizers_worker.py``: 2 ranks, then 4 (uneven shards, one rank with an empty
shard of the output layer). Each scenario runs under ``fsdp2`` and under ``ddp`` in the same launch; every class of
``torch.optim`` is either equal to DDP or refused by name; checkpoints saved by the 2-rank launch (sharded and full)
are resumed by the 4-rank one, each against DDP doing the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from integration_tests.conftest import max_relative_difference, torchrun
from testkit.optimizers import TORCH_OPTIMIZERS

# optimizer[+penalty][+manual][+accumulate][+hybrid]; manual runs also renorm each layer's rows after the step;
# hybrid: fsdp2 on a (replicate, shard) = (2, 2) mesh against ddp on 4 ranks.
PARITY = {
    2: [
        "muon",
        "muon_adamw+l2+manual",
        "muon+distance+accumulate",
        "muon+penalty_only",
        "muon+anchored",
        "adafactor",
        "adafactor+l2+accumulate",
        "hf_adafactor",
        "hf_adafactor_beta1",
        "hf_adafactor+distance+manual",
    ],
    4: [
        "muon",
        "muon_adamw+l2+manual",
        "muon+penalty_only",
        "muon+anchored",
        "muon+hybrid",
        "adafactor",
        "adafactor+hybrid",
        "hf_adafactor",
        "hf_adafactor_beta1+l2",
    ],
}
SAVED = [("muon", "full"), ("muon", "sharded"), ("adafactor", "sharded"), ("hf_adafactor", "full")]
REFUSED = {
    "LBFGS": "UnsupportedOptimizerError: `torch.optim.LBFGS` cannot train under FSDP2 as under DDP: its closure's line"
    " search runs over all parameters flattened into one vector, which each rank holds only a shard of, and its"
    " data-dependent inner loop must take the same turns on every rank. Instead, train it with"
    ' `strategy="ddp"` (L-BFGS fits models small enough to replicate).',
    "SparseAdam": "UnsupportedOptimizerError: `torch.optim.SparseAdam` cannot train under FSDP2 as under DDP: it"
    " needs sparse gradients (`nn.Embedding(sparse=True)`), and FSDP2 reduces dense gradient shards. Instead, use a"
    ' dense embedding with `torch.optim.Adam`, or `strategy="ddp"`.',
}


# An in-place op on `p[1]` after a manual step: under DDP a view of the parameter, under FSDP2 a copy of its rows.
INDEX_WRITE = "adafactor+manual+index_write"
INDEX_WRITE_REFUSAL = (
    "RuntimeError: `mul_` writes into an index of a sharded parameter (`p[0].zero_()`): under FSDP2 that is a copy of"
    " rows that this rank may not hold, where under DDP it is a view of the parameter, so the write would be lost."
    " Assign instead (`p[0] = 0.0`, `p[0] = p[0] * 0.5`: written into the shards), or change the whole parameter"
    " (`p.mul_(mask)`)."
)


def _runs(scenarios: list[str]) -> list[str]:
    return [f"{strategy}/{scenario}" for scenario in scenarios for strategy in ("fsdp2", "ddp")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("optimizers")


def _launch(workdir: Path, nproc: int, runs: list[str]) -> dict:
    out = workdir / f"results_{nproc}.pt"
    torchrun(
        "integration_tests.optimizers_worker", ["--runs", ",".join(runs), "--out", str(out)], nproc=nproc, cwd=workdir
    )
    return torch.load(out)


@pytest.fixture(scope="module")
def two_ranks(workdir: Path) -> dict:
    runs = _runs(PARITY[2] + [f"torch.optim.{name}" for name in TORCH_OPTIMIZERS] + [INDEX_WRITE])
    runs += [f"fsdp2/save:{optimizer}:{kind}" for optimizer, kind in SAVED]
    runs += [f"ddp/save:{optimizer}:full" for optimizer in sorted({o for o, _ in SAVED})]
    return _launch(workdir, 2, runs)


@pytest.fixture(scope="module")
def four_ranks(workdir: Path, two_ranks: dict) -> dict:  # after the 2-rank launch: it resumes its checkpoints
    runs = _runs(PARITY[4])
    runs += [f"fsdp2/resume:{optimizer}:{kind}" for optimizer, kind in SAVED]
    runs += [f"ddp/resume:{optimizer}:full" for optimizer in sorted({o for o, _ in SAVED})]
    return _launch(workdir, 4, runs)


def _assert_as_ddp(results: dict, scenario: str) -> None:
    sharded, reference = results[f"fsdp2/{scenario}"], results[f"ddp/{scenario}"]
    assert "error" not in sharded, sharded.get("error")
    assert max_relative_difference(sharded["params"], reference["params"]) <= 1e-5
    for metric, value in reference["metrics"].items():
        assert sharded["metrics"][metric] == pytest.approx(value, rel=1e-5), metric


@pytest.mark.parametrize("scenario", PARITY[2])
def test_two_ranks_train_as_ddp(two_ranks: dict, scenario: str) -> None:
    _assert_as_ddp(two_ranks, scenario)


@pytest.mark.parametrize("scenario", PARITY[4])
def test_four_ranks_with_uneven_shards_train_as_ddp(four_ranks: dict, scenario: str) -> None:
    _assert_as_ddp(four_ranks, scenario)


@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZERS))
def test_every_torch_optimizer_trains_as_ddp_or_is_refused_by_name(two_ranks: dict, name: str) -> None:
    scenario = f"torch.optim.{name}"
    if name in REFUSED:
        sharded = two_ranks[f"fsdp2/{scenario}"]
        assert sharded == {"error": REFUSED[name], "global_step": 0}  # before the first step
        return
    _assert_as_ddp(two_ranks, scenario)


@pytest.mark.parametrize(("optimizer", "kind"), SAVED)
def test_a_checkpoint_of_two_ranks_resumes_on_four_as_ddp_resumes_its_own(
    four_ranks: dict, two_ranks: dict, optimizer: str, kind: str
) -> None:
    saved = two_ranks[f"fsdp2/save:{optimizer}:{kind}"]
    assert max_relative_difference(saved["params"], two_ranks[f"ddp/save:{optimizer}:full"]["params"]) <= 1e-5
    resumed, reference = four_ranks[f"fsdp2/resume:{optimizer}:{kind}"], four_ranks[f"ddp/resume:{optimizer}:full"]
    assert resumed["global_step"] == reference["global_step"] == 6
    assert max_relative_difference(resumed["params"], reference["params"]) <= 1e-5


@pytest.mark.parametrize("optimizer", sorted({o for o, kind in SAVED if kind == "full"}))
def test_a_full_checkpoint_holds_the_optimizer_state_ddp_holds(workdir: Path, two_ranks: dict, optimizer: str) -> None:
    sharded = torch.load(workdir / f"fsdp2-{optimizer}-full.ckpt", weights_only=False)["optimizer_states"]
    reference = torch.load(workdir / f"ddp-{optimizer}-full.ckpt", weights_only=False)["optimizer_states"]
    assert len(sharded) == len(reference) == 1
    assert sharded[0]["state"].keys() == reference[0]["state"].keys()
    for index, entries in reference[0]["state"].items():
        assert sharded[0]["state"][index].keys() == entries.keys()
        for key, value in entries.items():
            mine = sharded[0]["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert mine.shape == value.shape, (index, key)
                assert torch.allclose(mine.float(), value.float(), rtol=1e-5, atol=1e-7), (index, key)
            else:
                assert mine == pytest.approx(value, rel=1e-5), (index, key)


def test_a_write_into_an_index_of_a_shard_is_refused_at_its_first_call_naming_the_fix(two_ranks: dict) -> None:
    assert "error" not in two_ranks[f"ddp/{INDEX_WRITE}"]
    # at its first call, right after the first manual step
    assert two_ranks[f"fsdp2/{INDEX_WRITE}"] == {"error": INDEX_WRITE_REFUSAL, "global_step": 1}
