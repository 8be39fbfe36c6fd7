"""Launches real multi-process CPU runs of ``integration_tests.worker`` and loads their results."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from testkit import free_port

REPO = Path(__file__).resolve().parent.parent


def torchrun(
    module: str,
    args: list[str],
    *,
    nproc: int,
    cwd: Path,
    check: bool = True,
    timeout: float = 600,
    max_restarts: int = 0,
):
    """Runs ``python -m module`` on ``nproc`` CPU processes under torchrun."""
    # --standalone rendezvous picks a free port itself, so parallel tests never collide.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [f"--max-restarts={max_restarts}", "-m", module]
    return _run([*cmd, *args], cwd=cwd, env=_environment(), check=check, timeout=timeout)


def launch(
    args: list[str],
    tmp_path: Path,
    *,
    nproc: int,
    launcher: str = "torchrun",
    timeout: float = 600,
    module: str = "integration_tests.worker",
) -> dict:
    """Runs a worker module on ``nproc`` CPU processes and returns rank 0's results (what it saved to ``--out``)."""
    out = tmp_path / f"result_{len(list(tmp_path.glob('result_*')))}.pt"
    if launcher == "torchrun":
        torchrun(module, [*args, "--out", str(out)], nproc=nproc, cwd=tmp_path, timeout=timeout)
    else:
        env = {**_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        cmd = [sys.executable, "-m", module, *args, "--devices", str(nproc), "--out", str(out)]
        _run(cmd, cwd=tmp_path, env=env, check=True, timeout=timeout)
    return torch.load(out)


def run_nodes(
    commands: list[list[str]], *, cwd: Path, envs: list[dict[str, str]], timeout: float, nodes: list[int] | None = None
) -> list[str]:
    """Runs the commands at the same time, command ``i`` on simulated node ``nodes[i]`` (default ``i``),
    in ``cwd/node{n}``, and returns each command's output. If any fails or the job outlives ``timeout``,
    every process group is killed and the error shows all outputs (a node's failure often shows only in
    its peer's log)."""
    procs, logs = [], []
    for node, cmd, env in zip(nodes or range(len(commands)), commands, envs, strict=True):
        node_dir = cwd / f"node{node}"
        node_dir.mkdir(parents=True, exist_ok=True)
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        # A session of its own: killing the group also ends the workers a launcher started.
        procs.append(
            subprocess.Popen(cmd, cwd=node_dir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            break
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(5)  # let the peers report how they saw the failure before they are killed
            break
        time.sleep(0.2)
    timed_out = time.monotonic() > deadline
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [proc.returncode for proc in procs]
    if any(codes):
        report = "\n".join(
            f"--- node {node}: {' '.join(cmd)} exited with {code} ---\n" + "\n".join(out.splitlines()[-40:])
            for node, cmd, code, out in zip(nodes or range(len(commands)), commands, codes, outputs)
        )
        reason = f"ran past its {timeout} s timeout" if timed_out else "failed"
        raise AssertionError(f"A multi-node job {reason}; the processes still running were killed:\n{report}")
    return outputs


def torchrun_nodes(
    module: str, args: list[str], *, nnodes: int, nproc_per_node: int, cwd: Path, timeout: float = 300
) -> list[str]:
    """Runs ``python -m module`` as a job of ``nnodes`` simulated nodes on this machine: one torchrun per
    node (``--node-rank``), static rendezvous on 127.0.0.1; returns each node's output."""
    port = free_port()
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node),
            "--nproc-per-node",
            str(nproc_per_node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            module,
            *args,
        ]
        for node in range(nnodes)
    ]
    return run_nodes(commands, cwd=cwd, envs=[_environment()] * nnodes, timeout=timeout)


def lightning_nodes(
    module: str, args: list[str], *, nnodes: int, devices: int, cwd: Path, timeout: float = 300
) -> list[str]:
    """The same job started by Lightning's own launcher: ``python -m module ... --devices N`` once per node,
    with ``MASTER_ADDR``, ``MASTER_PORT`` and ``NODE_RANK`` set; returns each node's output."""
    port = free_port()
    command = [sys.executable, "-m", module, *args, "--devices", str(devices)]
    envs = [
        {**_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node)}
        for node in range(nnodes)
    ]
    return run_nodes([command] * nnodes, cwd=cwd, envs=envs, timeout=timeout)


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


def max_absolute_difference(params: dict, reference: dict) -> float:
    assert params.keys() == reference.keys()
    return max((params[k] - reference[k]).abs().max().item() for k in reference)


@pytest.fixture
def run_worker(tmp_path: Path):
    def run(args: list[str], *, nproc: int, launcher: str = "torchrun") -> dict:
        return launch(args, tmp_path, nproc=nproc, launcher=launcher)

    return run
