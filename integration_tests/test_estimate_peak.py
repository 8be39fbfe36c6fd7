"""The estimator's step peak against the live-tensor peak of real 2- and 4-rank CPU training.

One torchrun launch per world size trains a small benchmark GPT (``testkit.peak_runs``) for two
optimizer steps per configuration, configurations one after another in the same processes, and every rank's
``ShardingMonitor`` counts its live tensors. Each configuration's prediction by ``fsdp_strategy.estimate`` on the
meta device must be within 10% of the largest rank's peak (the issue's target; the figures on the benchmark's
11M and 116M GPTs are in docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_strategy.estimator.report import estimate
from fsdp_strategy.tools.benchmark.gpt import GPT
from integration_tests.conftest import torchrun
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
    (row,) = estimate(GPT, init_args=MODEL, world_sizes=[world_size], strategies=[strategy], precision=precision,
                      batch_size=BATCH, seq_len=SEQ, activation_checkpointing=checkpointing).rows
    return row.checkpointed_peak_bytes if checkpointing else row.step_peak_bytes


@pytest.mark.parametrize(("world_size", "configs"), [(2, ALL), (4, FOUR_RANKS)])
def test_predicted_step_peak_is_within_ten_percent_of_the_live_tensor_peak(tmp_path: Path, world_size, configs):
    out = tmp_path / "peaks.json"
    args = ["--configs", ",".join(configs), "--model-args", json.dumps(MODEL), "--batch-size", str(BATCH),
            "--seq-len", str(SEQ), "--out", str(out)]
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
