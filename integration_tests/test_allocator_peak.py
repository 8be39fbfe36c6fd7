"""The step peak against the allocator's own count, an oracle that shares no code with the estimator.

The estimator predicts what ``LiveTensors`` counts (it runs that mode over fake tensors), and the other peak tests
measure with ``LiveTensors`` too, so a storage that it misses or counts twice would be missed by both sides. Here
glibc's ``mallinfo2()`` (``testkit.allocator_peak``) is read after every op of two real 1-rank training steps of
the benchmark GPT (about 1.7M parameters, 8 x 64 tokens: peaks of 35-52 MB), in a fresh interpreter whose CPU
kernels ran the same fit once before. Each side's figure is its peak less what it counted before the model was
built.

Measured on this project's CPU machine (glibc 2.36, torch 2.13; the figures repeat to within 40 KB from run to run):

* the allocator is 0.8% to 2.0% above ``LiveTensors`` (+0.38 MiB under ddp, +0.64 MiB under fsdp2, in fp32 and
  bf16 alike): memory that is not a tensor (presumably autograd's C++ nodes, Python objects over pymalloc's 512 bytes, malloc's
  headers and alignment of a few thousand small tensors). The bounds: never below ``LiveTensors`` (it cannot count
  more than malloc handed out), at most 4% above (twice the largest excess; missing the gradients would add 13%, one
  MLP activation of 2 MiB 4%).
* the estimator is -1.9% to +5.1% from the allocator: the issue's 10% holds against it too.

Without the first fit the allocator's figure also holds what the CPU kernels keep after their first call with each
shape (in-use bytes that jump at aten.addmm/aten.mm, and at CPU flash-attention's backward in bf16, with no tensor
created; presumably oneDNN's/BLAS's buffers, kept for the process's life): +3.2 MiB in fp32 and
+9.2 MiB in bf16 on this model, so the estimate is up to 8.7% (fp32) and 23% (bf16) below the allocator's count of
a process's first fit (``python -m testkit.allocator_peak --no-warmup`` measures it). That is the CPU libraries' behaviour, not
this project's, so no test pins it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_strategy import host_memory
from fsdp_strategy.estimator.report import estimate
from fsdp_strategy.tools.benchmark.gpt import GPT
from integration_tests.conftest import REPO
from testkit.peak_runs import parse_config

MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 256, "block_size": 64}
BATCH, SEQ = 8, 64

pytestmark = pytest.mark.skipif(host_memory.heap_stats() is None, reason="needs glibc's mallinfo2() (glibc 2.33+)")


def _measure(tmp_path: Path, config: str, *, warmup: bool = True) -> dict:
    out = tmp_path / "allocator.json"
    cmd = [
        sys.executable,
        "-m",
        "testkit.allocator_peak",
        "--config",
        config,
        "--model-args",
        json.dumps(MODEL),
        "--batch-size",
        str(BATCH),
        "--seq-len",
        str(SEQ),
        "--out",
        str(out),
        *([] if warmup else ["--no-warmup"]),
    ]
    # A fit of its own: no launcher's variables, so that it starts its own 1-rank group.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "WORLD_SIZE", "RANK", "LOCAL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    result["allocator"] = result["allocator_peak"] - result["allocator_before"]
    result["live"] = result["live_peak"] - result["tensors_before"]
    return result


def _predicted(config: str) -> int:
    strategy, precision, checkpointing = parse_config(config)
    (row,) = estimate(
        GPT,
        init_args=MODEL,
        world_sizes=[1],
        strategies=[strategy],
        precision=precision,
        batch_size=BATCH,
        seq_len=SEQ,
        activation_checkpointing=checkpointing,
    ).rows
    return row.checkpointed_peak_bytes if checkpointing else row.step_peak_bytes


@pytest.mark.parametrize(
    "config", ["fsdp2/32-true/none", "fsdp2/32-true/Block", "ddp/32-true/none", "fsdp2_grad_op/bf16-mixed/Block"]
)
def test_live_tensors_and_the_estimate_agree_with_the_allocator(tmp_path: Path, config: str) -> None:
    measured = _measure(tmp_path, config)
    allocator, live = measured["allocator"], measured["live"]
    assert measured["samples"] > 1000  # read after every op of both steps, not at the hooks alone
    assert live <= allocator <= 1.04 * live, (config, allocator, live, allocator / live)
    predicted = _predicted(config)
    assert predicted == pytest.approx(allocator, rel=0.10), (config, predicted, allocator, predicted / allocator)
