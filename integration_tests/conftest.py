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


def torchrun(module: str, args: list[str], *, nproc: int, cwd: Path, check: bool = True, timeout: float = 600):
    """Runs ``python -m module`` on ``nproc`` CPU processes under torchrun."""
    # --standalone rendezvous picks a free port itself, so parallel tests never collide.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", module]
    return _run([*cmd, *args], cwd=cwd, env=_environment(), check=check, timeout=timeout)


def launch(args: list[str], tmp_path: Path, *, nproc: int, launcher: str = "torchrun", timeout: float = 600) -> dict:
    """Runs the worker on ``nproc`` CPU processes and returns rank 0's results."""
    out = tmp_path / f"result_{len(list(tmp_path.glob('result_*')))}.pt"
    if launcher == "torchrun":
        torchrun("integration_tests.worker", [*args, "--out", str(out)], nproc=nproc, cwd=tmp_path, timeout=timeout)
    else:
        env = {**_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        cmd = [sys.executable, "-m", "integration_tests.worker", *args, "--devices", str(nproc), "--out", str(out)]
        _run(cmd, cwd=tmp_path, env=env, check=True, timeout=timeout)
    return torch.load(out)


def _environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], check: bool, timeout: float):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    return proc


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
