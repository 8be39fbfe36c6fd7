"""``ShardingMonitor`` on 2 CPU ranks under ``"fsdp2"`` and under ``"ddp"``, the reference run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from integration_tests.conftest import torchrun

BATCH_SIZE = 4  # token_loader's, as monitor_worker trains; every batch is full


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("monitor")
    proc = torchrun("integration_tests.monitor_worker", ["--out-dir", str(out_dir)], nproc=2, cwd=out_dir)
    summaries = {path.stem: json.loads(path.read_text()) for path in out_dir.glob("*_rank*.json")}
    return {"out_dir": out_dir, "stdout": proc.stdout, "summaries": summaries}


def test_every_rank_gets_a_row_per_rank_and_the_same_summary(runs):
    summaries = runs["summaries"]
    assert sorted(summaries) == ["ddp_rank0", "ddp_rank1", "fsdp2_rank0", "fsdp2_rank1"]
    for strategy in ("fsdp2", "ddp"):
        zero, one = summaries[f"{strategy}_rank0"], summaries[f"{strategy}_rank1"]
        assert [r["rank"] for r in zero["ranks"]] == [0, 1]
        assert zero["ranks"] == one["ranks"]  # gathered on every rank, not only on rank 0
        assert zero["world_size"] == 2 and zero["strategy"] == strategy and zero["steps"] == 8
        assert zero["measured_batches"] == 6  # after 2 warm-up steps; validation time left out
        assert all(
            r["peak_rss_bytes"] > 0 and r["samples_per_sec"] > 0 and r["tflops_per_sec"] > 0 for r in zero["ranks"]
        )
        # all ranks' samples over the slowest rank's time, each rank's time recovered from its own row
        samples_per_rank = zero["measured_batches"] * BATCH_SIZE
        seconds = [samples_per_rank / r["samples_per_sec"] for r in zero["ranks"]]
        assert zero["measured_seconds"] == pytest.approx(max(seconds), rel=1e-6)
        assert zero["samples_per_sec"] == pytest.approx(samples_per_rank * len(seconds) / max(seconds), rel=1e-6)
    # the table is printed once per run, by rank 0
    assert runs["stdout"].count("ShardingMonitor: fsdp2 | 2 x cpu") == 1
    assert runs["stdout"].count("ShardingMonitor: ddp | 2 x cpu") == 1


def test_fsdp2_holds_half_of_ddps_model_state_and_reports_its_communication(runs):
    fsdp2, ddp = runs["summaries"]["fsdp2_rank0"], runs["summaries"]["ddp_rank0"]
    for rank in (0, 1):
        ratio = fsdp2["ranks"][rank]["model_state_bytes"] / ddp["ranks"][rank]["model_state_bytes"]
        assert 0.45 <= ratio <= 0.55, ratio
    assert fsdp2["flops_per_batch"] == ddp["flops_per_batch"]  # the same math, sharded or not
    assert fsdp2["all_gather_bytes"] > 0 and fsdp2["reduce_scatter_bytes"] > 0 and fsdp2["all_reduce_bytes"] == 0
    assert ddp["all_reduce_bytes"] > 0 and ddp["all_gather_bytes"] == ddp["reduce_scatter_bytes"] == 0
    for summary in (fsdp2, ddp):  # the estimate from the plan against what the ranks hold
        assert summary["estimated_model_state_bytes"] == pytest.approx(summary["max_model_state_bytes"], rel=0.10)


def test_logged_metrics_reach_the_csv_logger(runs):
    for strategy in ("fsdp2", "ddp"):
        with open(Path(runs["out_dir"]) / strategy / "version_0" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        logged = [r for r in rows if r.get("monitor/samples_per_sec")]
        assert [int(r["step"]) for r in logged] == [3, 5, 7]
        assert all(float(r["monitor/peak_rss_mib"]) > 0 for r in logged)
        final = [r for r in rows if r.get("monitor/model_state_mib")]
        assert len(final) == 1
        collective = "all_gather" if strategy == "fsdp2" else "all_reduce"
        assert float(final[0][f"monitor/{collective}_mib_per_step"]) > 0
