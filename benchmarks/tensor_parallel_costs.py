"""What the estimator says a 2 x 2 tensor-parallel run holds and moves, against what 4 gloo ranks measure, for
docs/benchmarks.md.

    OMP_NUM_THREADS=1 python benchmarks/tensor_parallel_costs.py

It launches ``integration_tests.tensor_parallel_cost_worker`` on 4 CPU processes (``FSDP2Strategy(
tensor_parallel_size=2)``: the testkit GPT split in ``configure_model`` and sharded by the strategy, and the tiny
Hugging Face Llama split by its ``base_model_tp_plan``; 4 samples of 8 tokens per data-parallel rank, fp32, AdamW),
which measures each rank's parameters, gradients and optimizer state and the bytes of the first optimizer step's
collectives. Against them: ``fsdp_strategy.estimate`` of the same model on the meta device with
``tensor_parallel_size=2`` and the step traced on a batch of that shape, and, for comparison, the estimate that
ignores tensor parallelism (``tensor_parallel_size=1`` at world size 4, what the estimator and ``ShardingMonitor``
reported before they knew the tensor-parallel size). Prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fsdp_strategy.estimator.report import estimate  # noqa: E402
from integration_tests.tensor_parallel_cost_worker import BATCH_SIZE  # noqa: E402
from testkit.models import SEQ  # noqa: E402
from testkit.tensor_parallel import plan_styles  # noqa: E402

GPT = ("testkit.tensor_parallel:TensorParallelGPT", {"parallelize": "none"})
LLAMA = ("testkit.hf:TinyLlama", {})


def measure() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "measured.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
        command += ["-m", "integration_tests.tensor_parallel_cost_worker", "--runs", "tp,hf", "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(command, cwd=tmp, env=env, check=True, capture_output=True)
        return json.loads(out.read_text())


def row_of(target: tuple[str, dict], tensor_parallel_size: int, plan: dict | None):
    name, init_args = target
    report = estimate(
        name,
        init_args=init_args,
        world_sizes=[4],
        strategies=["fsdp2"],
        tensor_parallel_size=tensor_parallel_size,
        tensor_parallel_plan=plan,
        batch_size=BATCH_SIZE,
        seq_len=SEQ,
    )
    return report.rows[0]


def main() -> None:
    measured = measure()
    print("| model | figure (bytes per rank) | measured | estimate, 2x2 | estimate ignoring tensor parallelism |")
    print("|---|---|---:|---:|---:|")
    for run, label, target, plan in (("tp", "GPT", GPT, plan_styles()), ("hf", "TinyLlama", LLAMA, None)):
        now, before = row_of(target, 2, plan), row_of(target, 1, None)
        moved = measured[run]["collectives"][0]
        figures = (
            ("parameters + gradients + AdamW state", max(measured[run]["held"]), "model_state_bytes"),
            ("FSDP2 all-gather per step", moved["c10d/all_gather"], "all_gather_bytes"),
            ("FSDP2 reduce-scatter per step", moved["c10d/reduce_scatter"], "reduce_scatter_bytes"),
            ("activation all-reduce per step", moved["functional/all_reduce"], "tensor_parallel_all_reduce_bytes"),
        )
        for figure, value, field in figures:
            old = getattr(before, field)
            print(f"| {label} | {figure} | {value:,} | {getattr(now, field):,} | {'-' if not old else f'{old:,}'} |")


if __name__ == "__main__":
    main()
