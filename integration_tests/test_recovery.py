"""Lost ranks: torchrun restarts resume exactly, and survivors name the rank they lost instead of hanging.

The restart tests run under ``torchrun --max-restarts 1``. The lost-peer tests start one process per
"node" by hand, the way a cluster scheduler does, so that no torchrun agent kills the survivors first.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fsdp_strategy.checkpoint import verify
from integration_tests.conftest import _environment, max_relative_difference, torchrun
from testkit import free_port

WORKER = "integration_tests.recovery_worker"


def _elastic_run(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.pt"
    torchrun(
        WORKER,
        ["--checkpoint-dir", str(tmp_path / name), "--out", str(out), *extra],
        nproc=2,
        cwd=tmp_path,
        max_restarts=1,
    )
    return torch.load(out)


def test_killed_ranks_restart_from_the_last_complete_checkpoint_and_match_an_uninterrupted_run(tmp_path: Path) -> None:
    runs = {"reference": (), "killed_in_training": ("--kill-at-step", "6"), "killed_in_save": ("--kill-in-save", "3")}
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(_elastic_run, tmp_path, name, *extra) for name, extra in runs.items()}
        results = {name: future.result() for name, future in futures.items()}

    reference = results["reference"]
    assert (reference["attempt"], reference["started_at_step"], reference["global_step"]) == (0, 0, 12)
    for name in ("killed_in_training", "killed_in_save"):
        result = results[name]
        assert (tmp_path / f"{name}.killed").exists(), f"{name}: the rank was never killed"
        # Saves: step 4 (top-k, then last), step 8 (top-k: killed_in_save dies in it), ...
        assert (result["attempt"], result["started_at_step"], result["global_step"]) == (1, 4, 12), name
        assert max_relative_difference(result["params"], reference["params"]) <= 1e-6, name

    directory = tmp_path / "killed_in_save"
    visible = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    assert visible == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
    for name in visible:
        verify.verify_sharded_checkpoint(directory / name)  # every checkpoint a resume could pick is whole
    # The restarted attempt's first save removed the staging that the killed attempt abandoned.
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]


def _by_hand(tmp_path: Path, world_size: int, ranks: list[int], port: int, *extra: str) -> dict[int, subprocess.Popen]:
    """Starts the given ranks, one per node, with the variables a scheduler would set (no torchrun agent)."""
    procs = {}
    tmp_path.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        env = {
            **_environment(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "GROUP_RANK": str(rank),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "TORCHELASTIC_RUN_ID": "by-hand",
        }
        cmd = [
            sys.executable,
            "-m",
            WORKER,
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--out",
            str(tmp_path / "run.pt"),
            *extra,
        ]
        procs[rank] = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return procs


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, " ".join(output.split())


def _stop(procs: dict[int, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_dead_peer_is_named_by_the_survivor(tmp_path: Path) -> None:
    procs = _by_hand(tmp_path, 2, [0, 1], free_port(), "--timeout", "10", "--kill-at-step", "3")
    try:
        code, output = _finish(procs[0], timeout=300)
    finally:
        _stop(procs)
    assert (tmp_path / "run.killed").exists()
    assert code != 0
    assert "FSDP2Strategy: a collective failed. Lost 1 of 2 ranks: rank 1 (node 1, local rank 0, host" in output, (
        output[-3000:]
    )
    assert "Every rank of node 1 is gone: that node was probably lost." in output
    assert 'with `torchrun --max-restarts N` and `trainer.fit(..., ckpt_path="last")`' in output


def test_a_stuck_peer_fails_the_others_after_the_timeout_naming_who_is_behind(tmp_path: Path) -> None:
    procs = _by_hand(tmp_path, 2, [0, 1], free_port(), "--timeout", "5", "--hang-at-step", "3")
    try:
        code, output = _finish(procs[0], timeout=300)
    finally:
        _stop(procs)
    assert code != 0
    assert "Every rank is still alive, so one of them did not reach the same collective in time" in output, output[
        -3000:
    ]
    assert "Global step per rank: rank 0: 3, rank 1: 2. Rank 1 is behind." in output


def test_ranks_that_never_arrive_are_named(tmp_path: Path) -> None:
    lonely_rank0 = _by_hand(tmp_path / "a", 2, [0], free_port(), "--timeout", "5")
    lonely_rank1 = _by_hand(tmp_path / "b", 2, [1], free_port(), "--timeout", "5")
    try:
        code0, output0 = _finish(lonely_rank0[0], timeout=300)
        code1, output1 = _finish(lonely_rank1[1], timeout=300)
    finally:
        _stop(lonely_rank0)
        _stop(lonely_rank1)
    assert code0 != 0 and code1 != 0
    assert "PeerLostError: Rank 1 (node 1) of 2 did not join within 5 s (seen from rank 0 (node 0" in output0, output0[
        -3000:
    ]
    assert "could not reach the rendezvous store of rank 0 (node 0) at 127.0.0.1:" in output1, output1[-3000:]
    assert "within 5 s" in output1
