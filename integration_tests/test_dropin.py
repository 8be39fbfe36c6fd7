"""What DDP does without being asked, and with ``find_unused_parameters=True``: 2 CPU ranks, one launch.

Every scenario of ``integration_tests/dropin_worker.py`` runs under ``fsdp2`` and under its DDP
reference in the same process pair: modules whose parameters go unused on some ranks against
``ddp_find_unused_parameters_true``; a module built with a different init on each rank and buffers
updated in forward against ``ddp``; ``sync_batchnorm=True`` on the CPU against ``ddp``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from integration_tests.conftest import max_relative_difference, torchrun

UNUSED = ["moe", "moe_sgd", "moe_accumulate", "branch", "branch_sgd_accumulate"]
BUFFERS = ["bn", "bn_adamw_accumulate", "bn_manual"]
REFERENCE = {**{s: "ddp_find_unused_parameters_true" for s in UNUSED}, **{s: "ddp" for s in [*BUFFERS, "syncbn"]}}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("dropin")
    out = tmp_path / "results.pt"
    runs = [f"{strategy}/{scenario}" for scenario, ddp in REFERENCE.items() for strategy in ("fsdp2", ddp)]
    torchrun("integration_tests.dropin_worker", ["--runs", ",".join(runs), "--out", str(out)], nproc=2, cwd=tmp_path)
    return torch.load(out)


@pytest.mark.parametrize("scenario", UNUSED)
def test_parameters_unused_on_some_ranks_train_as_with_find_unused_parameters(results: dict, scenario: str) -> None:
    sharded, reference = results[f"fsdp2/{scenario}"], results[f"{REFERENCE[scenario]}/{scenario}"]
    assert max_relative_difference(sharded["params"], reference["params"]) <= 1e-5
    for metric, value in reference["callback_metrics"].items():
        assert sharded["callback_metrics"][metric] == pytest.approx(value, rel=1e-5), metric


@pytest.mark.parametrize("scenario", BUFFERS)
def test_rank_zero_init_and_buffers_as_under_ddp(results: dict, scenario: str) -> None:
    sharded, reference = results[f"fsdp2/{scenario}"], results[f"ddp/{scenario}"]
    assert max_relative_difference(sharded["params"], reference["params"]) <= 1e-5
    for rank, (mine, theirs) in enumerate(zip(sharded["per_rank"], reference["per_rank"])):
        # After the last batch each rank holds its own update of rank 0's buffers; validation then
        # starts from rank 0's: both as under DDP.
        for when in ("buffers_after_last_batch", "buffers"):
            assert mine[when].keys() == theirs[when].keys()
            for name, value in theirs[when].items():
                assert torch.allclose(mine[when][name].float(), value.float(), rtol=1e-5, atol=1e-7), (rank, when, name)
    after_batch = [r["buffers_after_last_batch"]["features.1.running_mean"] for r in reference["per_rank"]]
    assert not torch.allclose(*after_batch)  # the data give the ranks different statistics
    for metric in ("val_loss", "val_accuracy"):
        assert sharded["callback_metrics"][metric] == pytest.approx(reference["callback_metrics"][metric], rel=1e-5)


def test_sync_batchnorm_converts_and_fails_on_the_cpu_as_under_ddp(results: dict) -> None:
    sharded, reference = results["fsdp2/syncbn"], results["ddp/syncbn"]
    assert reference["error"] == "ValueError: SyncBatchNorm layers only work with GPU modules"
    assert sharded == reference
    assert sharded["at_failure"] == ["SyncBatchNorm", "SyncBatchNorm"]
