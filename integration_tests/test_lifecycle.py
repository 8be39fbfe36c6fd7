"""Nothing survives its Trainer, and a second fit in the same process is the first one again: six runs in one
2-rank process (``integration_tests/lifecycle_worker.py``), among them a failed fit and one that leaves the module
sharded, under ``fsdp2`` and, as the reference, ``ddp``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from integration_tests.conftest import torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("lifecycle")
    results = {}
    for strategy in ("fsdp2", "ddp"):
        out = tmp_path / f"{strategy}.pt"
        torchrun(
            "integration_tests.lifecycle_worker", ["--strategy", strategy, "--out", str(out)], nproc=2, cwd=tmp_path
        )
        results[strategy] = torch.load(out, weights_only=False)
    return results


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_no_module_and_no_tensor_of_a_finished_run_stays_reachable_on_any_rank(runs: dict, strategy: str) -> None:
    for rank, records in enumerate(runs[strategy]["per_rank"]):
        kinds = [r["kind"] for r in records]
        assert kinds == ["before", "fit", "fit", "failed", "left_sharded", "stages", "fit"]
        assert [r["modules"] for r in records] == [0] * len(records), rank
        after_first = records[1]["bytes"]
        # Flat from the first fit on: the failed fit and the one that left its module sharded included.
        assert [r["bytes"] for r in records[1:]] == [after_first] * (len(records) - 1), (rank, records)
    # What the first fit leaves for good (process-wide state: fsdp2's device mesh) is a few bytes, as under DDP.
    assert runs["fsdp2"]["per_rank"][0][1]["bytes"] - runs["ddp"]["per_rank"][0][1]["bytes"] <= 64


def test_the_runs_are_what_they_say(runs: dict) -> None:
    records = {r["kind"]: r for r in runs["fsdp2"]["records"]}
    assert records["failed"]["error"] == "a bad trial"
    assert records["left_sharded"]["sharded_after_fit"] is True


def test_a_later_fit_with_the_same_seed_ends_with_the_first_fits_parameters(runs: dict) -> None:
    fits = [r["params"] for r in runs["fsdp2"]["records"] if "params" in r]
    assert len(fits) == 4  # fit, fit, the fit before validate/test/predict, the last fit
    for later in fits[1:]:
        assert later.keys() == fits[0].keys()
        assert all(np.array_equal(later[k], fits[0][k]) for k in fits[0])
