"""Launches real multi-process CPU runs of ``integration_tests.worker`` and loads their results."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: list[str], tmp_path: Path, *, nproc: int, launcher: str = "torchrun", timeout: float = 600) -> dict:
    """Runs the worker on ``nproc`` CPU processes and returns rank 0's results."""
    out = tmp_path / f"result_{len(list(tmp_path.iterdir()))}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if launcher == "torchrun":
        # --standalone rendezvous picks a free port itself, so parallel tests never collide.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += ["-m", "integration_tests.worker", *args, "--out", str(out)]
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = [sys.executable, "-m", "integration_tests.worker", *args, "--devices", str(nproc), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    return torch.load(out)


def max_relative_difference(params: dict, reference: dict) -> float:
    assert params.keys() == reference.keys()
    return max(
        ((params[k] - reference[k]).abs().max() / reference[k].abs().max().clamp_min(1e-12)).item() for k in reference
    )


@pytest.fixture
def run_worker(tmp_path: Path):
    def run(args: list[str], *, nproc: int, launcher: str = "torchrun") -> dict:
        return launch(args, tmp_path, nproc=nproc, launcher=launcher)

    return run
