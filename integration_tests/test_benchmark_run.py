"""One real (tiny) ``fsdp-strategy benchmark`` run of ddp, fsdp2 and raw FSDP2 on 2 ranks: what its figures must say
about each other, and that its JSON, CSV and table say the same."""

from __future__ import annotations

import csv
import json

import pytest

from fsdp_strategy.tools.benchmark.report import CSV_FIELDS
from fsdp_strategy.tools.benchmark.run import run_benchmark

STRATEGIES = ["ddp", "fsdp2", "raw_fsdp2"]


def test_a_tiny_run_on_two_ranks(tmp_path, capsys, monkeypatch):
    # The allocator recipe of docs/benchmarks.md is passed on to the jobs (they must run with it) and recorded.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    summary = run_benchmark(
        size="tiny",
        strategies=STRATEGIES,
        world_sizes=[2],
        steps=3,
        warmup=0,
        repeats=1,
        batch_size=2,
        seq_len=16,
        out=tmp_path,
        progress=False,
    )
    assert [(e["strategy"], e["world_size"]) for e in summary] == [(s, 2) for s in STRATEGIES]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["machine"]["malloc_mmap_threshold"] == "4194304"
    assert results["config"]["title"].endswith("; MALLOC_MMAP_THRESHOLD_=4194304")

    rows = results["rows"]
    by_job = {s: sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["rank"]) for s in STRATEGIES}
    assert len(rows) == 6 and all([r["rank"] for r in job] == [0, 1] for job in by_job.values())  # a row per rank
    # Sharding halves each rank's model state at 2 ranks (the tiny GPT's shapes divide by 2); ddp's is whole.
    for strategy in ("fsdp2", "raw_fsdp2"):
        for sharded, whole in zip(by_job[strategy], by_job["ddp"], strict=True):
            assert sharded["model_state_bytes"] == pytest.approx(whole["model_state_bytes"] / 2, rel=0.01), strategy
    for entry in summary:  # the ideal is 1/N of the whole state: what the sharded jobs hold, half of ddp's
        ideal = 2.0 if entry["strategy"] == "ddp" else 1.0
        assert entry["model_state_over_ideal"] == pytest.approx(ideal, abs=0.01), entry["strategy"]
    # The loss of the third step, after two updates: the same model, data and math under every strategy.
    losses = {s: [r["loss_last"] for r in job] for s, job in by_job.items()}
    for strategy in STRATEGIES:
        assert losses[strategy] == pytest.approx(losses["ddp"], rel=1e-5), strategy
    # Throughput and timing are measured, not left at zero.
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["samples_per_s"] > 0 for r in rows)

    # The CSV holds the JSON's rows, field for field.
    with open(tmp_path / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [tuple(r.keys()) for r in table] == [CSV_FIELDS] * len(rows)
    for line, row in zip(table, rows, strict=True):
        for field in CSV_FIELDS:
            assert line[field] == str(row[field]), (field, line[field], row[field])
    # The printed table has a line per job with its model state in MiB, the worst rank's, as the summary has it.
    out = capsys.readouterr().out
    for entry in summary:
        assert f"| {entry['strategy']} | 2 |" in out
        mib = max(r["model_state_bytes"] for r in by_job[entry["strategy"]]) / 2**20
        assert entry["model_state_bytes"] == max(r["model_state_bytes"] for r in by_job[entry["strategy"]])
        line = next(row for row in out.splitlines() if row.startswith(f"| {entry['strategy']} | 2 |"))
        assert f"| {mib:,.1f} |" in line, (line, mib)
    assert (tmp_path / "plot.png").is_file()
