"""``nonfinite_grads`` on 2 CPU ranks: a gradient that is infinite in rank 1's shard only, at step 3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from integration_tests.conftest import REPO, max_relative_difference, torchrun
from testkit import free_port


def test_skip_skips_the_step_on_every_rank_as_a_run_that_drops_it(tmp_path: Path) -> None:
    # Reference: DDP without poison or guard, whose callback drops the gradients of step 3.
    out = tmp_path / "result.pt"
    torchrun(
        "integration_tests.guard_worker", ["--runs", "fsdp2_skip,ddp_drop", "--out", str(out)], nproc=2, cwd=tmp_path
    )
    results = torch.load(out)
    skipped, reference = results["fsdp2_skip"], results["ddp_drop"]
    assert skipped["skipped_steps"] == [1, 1]
    assert max_relative_difference(skipped["params"], reference["params"]) <= 1e-5


def test_raise_fails_every_rank_naming_the_parameter(tmp_path: Path) -> None:
    # Each rank is its own process here (no torchrun to stop the others at the first failure), so
    # every rank's own exit code and message are seen.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NODE_RANK": "0",
        "WORLD_SIZE": "2",
    }
    cmd = [sys.executable, "-m", "integration_tests.guard_worker", "--runs", "fsdp2_raise", "--devices", "2"]
    ranks = [
        subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env={**env, "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        # A rank left waiting would sit out the strategy's 1800 s collective timeout: far past this one,
        # which only allows for a loaded machine.
        outputs = [rank.communicate(timeout=600)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    expected = (
        "NonFiniteGradientError: Non-finite gradient at global step 3: the gradients of 1 of 31 parameters hold"
        " NaN or inf, the first being `scale`."
    )
    for rank, output in zip(ranks, outputs):
        assert rank.returncode != 0, output[-3000:]
        assert expected in output, output[-3000:]
