"""The estimator's step peak against the live-tensor peak of real 2- and 4-rank CPU training.

One torchrun launch per world size trains a small benchmark GPT (``testkit.peak_runs``) for two
optimizer steps per configuration, configurations one after another in the same processes, and every rank's
``ShardingMonitor`` counts its live tensors. Each configuration's prediction by ``fsdp_strategy.estimate`` on the
meta device must be within 10% of the largest rank's peak (the issue's target; the figures on the benchmark's
11M and 116M GPTs are in docs/benchmarks.md). Below, the same comparison at one rank on the tiny LM, whose activations
are a large share of the peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_strategy.estimator.report import estimate
from fsdp_strategy.tools.benchmark.gpt import GPT
from integration_tests.conftest import REPO, torchrun
from testkit.models import SEQ as TINY_SEQ
from testkit.models import TinyLM
from testkit.peak_runs import parse_config

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}
BATCH, SEQ = 16, 32
ALL = [
    f"{strategy}/{precision}/{checkpointing}"
    for precision in ("32-true", "bf16-mixed")
    for strategy in ("ddp", "fsdp2_grad_op", "fsdp2")
    for checkpointing in ("none", "Block")
]
# At 4 ranks, one configuration of each strategy and of each precision and checkpointing choice.
FOUR_RANKS = ["fsdp2/32-true/none", "fsdp2_grad_op/bf16-mixed/Block", "ddp/bf16-mixed/none", "fsdp2/bf16-mixed/Block"]


def _predicted(config: str, world_size: int) -> int:
    strategy, precision, checkpointing = parse_config(config)
    (row,) = estimate(
        GPT,
        init_args=MODEL,
        world_sizes=[world_size],
        strategies=[strategy],
        precision=precision,
        batch_size=BATCH,
        seq_len=SEQ,
        activation_checkpointing=checkpointing,
    ).rows
    return row.checkpointed_peak_bytes if checkpointing else row.step_peak_bytes


@pytest.mark.parametrize(("world_size", "configs"), [(2, ALL), (4, FOUR_RANKS)])
def test_predicted_step_peak_is_within_ten_percent_of_the_live_tensor_peak(tmp_path: Path, world_size, configs):
    out = tmp_path / "peaks.json"
    args = [
        "--configs",
        ",".join(configs),
        "--model-args",
        json.dumps(MODEL),
        "--batch-size",
        str(BATCH),
        "--seq-len",
        str(SEQ),
        "--out",
        str(out),
    ]
    torchrun("testkit.peak_runs", args, nproc=world_size, cwd=tmp_path)
    measured = json.loads(out.read_text())
    errors = {}
    for config in configs:
        # The largest rank, the one that runs out of memory first. Now and then one rank's peak holds a block's
        # reduce-scatter input once more than the estimate: gloo copies the input, and its worker thread lets go
        # of the copy after the (synchronous) collective has returned, sometimes only after the next block's
        # recomputation has begun. The estimate counts the copy during the collective only; at 16 samples a
        # block is about 5% of this peak (at 2 it was 17%).
        peak = max(measured[config])
        errors[config] = (_predicted(config, world_size) - peak) / peak
    assert all(abs(error) <= 0.10 for error in errors.values()), errors


# --- one rank, the tiny LM, each fit in a fresh interpreter (moved from tests/test_estimate_peak.py) ---

# Set by the tests' launchers; the fit must start its own 1-rank group.
_LAUNCHER_VARIABLES = (
    "MASTER_",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "TORCHELASTIC",
)


# Run in a fresh interpreter: in this process, tensors that earlier tests left behind (sharded modules whose
# last references go away at some later point) count as live too, and when they are freed between the count
# taken before the fit and its peak, they lower the measurement by their size (by half on this tiny model).
_MEASURE = """
import gc, json, sys
import lightning as L
from fsdp_strategy.estimator.live_tensors import LiveTensors, existing_tensors
from testkit.models import TinyLM, token_loader
from testkit.peak_runs import live_peak_fit
def main():
    strategy, checkpointing = json.loads(sys.argv[1])
    gc.collect()
    with LiveTensors() as live:
        live.track(existing_tensors())
        before = live.current
    L.seed_everything(0, verbose=False)
    peak = live_peak_fit(TinyLM(), token_loader(batch_size=4, samples=16), strategy=strategy, checkpointing=checkpointing)
    print(json.dumps(peak - before))
main()
"""


def _measured_live_peak(strategy: str, checkpointing: list[str] | None) -> float:
    """The live-tensor peak of a real 1-rank fit of the tiny LM, less the tensors alive before it."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(_LAUNCHER_VARIABLES)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps([strategy, checkpointing])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("strategy", "checkpointing"), [("fsdp2", None), ("fsdp2", ["Block"]), ("fsdp2_grad_op", None), ("ddp", None)]
)
def test_predicted_peak_is_the_live_tensor_peak_of_a_real_fit(strategy, checkpointing):
    measured = _measured_live_peak(strategy, checkpointing)
    (row,) = estimate(
        TinyLM,
        world_sizes=[1],
        strategies=[strategy],
        batch_size=4,
        seq_len=TINY_SEQ,
        activation_checkpointing=checkpointing,
    ).rows
    predicted = row.checkpointed_peak_bytes if checkpointing else row.step_peak_bytes
    # Activations are a large share of this tiny model's peak, so leaving them out would fail the comparison.
    assert row.activation_bytes > 0.3 * measured
    # The 10%.
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)
