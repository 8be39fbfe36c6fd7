"""Checkpoints saved during fit (sync and async, sharded and full, through a CheckpointIO plugin) and
saves that fail, on real multi-process CPU runs compared with DDP (``integration_tests/save_worker.py``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from integration_tests.conftest import max_relative_difference, torchrun

ASYNC_RUNS = "ddp,fsdp2_full_async,fsdp2_sharded_async"
ALL_RUNS = ASYNC_RUNS + ",fsdp2_full,fsdp2_sharded"
FAILING_RUNS = "fsdp2_sharded,fsdp2_sharded_async,fsdp2_full,fsdp2_full_async"


def save_worker(tmp_path: Path, args: list[str], *, nproc: int) -> dict:
    out = tmp_path / "results.pt"
    torchrun("integration_tests.save_worker", [*args, "--out", str(out)], nproc=nproc, cwd=tmp_path)
    return torch.load(out, weights_only=False)


def assert_saved_during_fit_as_under_ddp(results: dict, directory: Path) -> None:
    ddp = results["ddp"]
    # Saved every 2 steps, top 2 kept: the step-2 and step-4 checkpoints were removed, nothing else is left.
    assert len(ddp["files"]) == 3 and "last.ckpt" in ddp["files"], ddp["files"]
    for run, result in results.items():
        assert result["files"] == ddp["files"], run
        kind = "dir" if "sharded" in run else "file"
        assert all(getattr(directory / run / name, f"is_{kind}")() for name in result["files"]), run
        assert (result["started_at"], result["global_step"]) == (6, 12), run
        difference = max_relative_difference(result["params"], ddp["params"])
        assert difference <= 1e-5, f"{run} resumed from its step-6 checkpoint differs from DDP's: {difference}"


@pytest.mark.parametrize("nproc", [1, 4])
def test_checkpoints_saved_in_the_background_during_fit_resume_as_under_ddp(tmp_path: Path, nproc: int) -> None:
    results = save_worker(
        tmp_path, ["--scenarios", "during_fit", "--runs", ASYNC_RUNS, "--checkpoint-dir", str(tmp_path)], nproc=nproc
    )
    assert_saved_during_fit_as_under_ddp(results["during_fit"], tmp_path)


def test_on_two_ranks_saves_during_fit_and_a_checkpoint_io_plugin_behave_as_under_ddp(tmp_path: Path) -> None:
    args = ["--scenarios", "during_fit,plugin", "--runs", ALL_RUNS, "--checkpoint-dir", str(tmp_path)]
    results = save_worker(tmp_path, args, nproc=2)
    assert_saved_during_fit_as_under_ddp(results["during_fit"], tmp_path)

    plugin = results["plugin"]
    ddp, fsdp2 = plugin["ddp"], plugin["fsdp2_full"]
    # The same calls on every rank: saves and top-k removals on rank 0, `storage_options` passed
    # through, a load on every rank, and the plugin's teardown after fit, test and the resumed fit.
    assert fsdp2["calls"] == ddp["calls"]
    rank0, rank1 = ddp["calls"]
    assert ("remove", "epoch=0-step=2.ckpt") in rank0 and ("save", "extra.ckpt", {"tier": "cold"}) in rank0
    assert rank1 == [("teardown",), ("teardown",), ("load", "last.ckpt", None), ("teardown",)]
    # Wrapped in AsyncCheckpointIO, the plugin saves on a thread: the same calls, in an order of its own.
    async_ddp, async_fsdp2 = plugin["ddp_async_io"], plugin["fsdp2_full_async_io"]
    assert [sorted(map(repr, calls)) for calls in async_fsdp2["calls"]] == [
        sorted(map(repr, c)) for c in async_ddp["calls"]
    ]
    for run, reference in (("fsdp2_full", ddp), ("fsdp2_full_async_io", async_ddp)):
        result = plugin[run]
        # The same files, written by the plugin (its extra key), holding the same state.
        assert (
            result["files"].keys()
            == reference["files"].keys()
            == {"epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt", "extra.ckpt"}
        )
        for name, saved in result["files"].items():
            assert saved.keys() == reference["files"][name].keys() and saved["saved_by"] == "RecordingIO", (run, name)
            assert max_relative_difference(saved["state_dict"], reference["files"][name]["state_dict"]) <= 1e-5, (
                run,
                name,
            )
        # trainer.test() after fit with the same Trainer, then a resume through the plugin.
        assert result["test"][0]["test_loss"] == pytest.approx(reference["test"][0]["test_loss"], rel=1e-5), run
        assert result["started_at"] == reference["started_at"] == 8, run
        assert max_relative_difference(result["params"], reference["params"]) <= 1e-5, run


def assert_failed_on_every_rank_and_resumable(results: dict, directory: Path, *, failing_rank: dict[str, str]) -> None:
    for run, result in results.items():
        expected = (
            re.escape(
                f"Could not save checkpoint '{directory / run / 'epoch=0-step=4.ckpt'}': no space left on device in"
            )
            + re.escape(f" '{directory / run}' (rank ")
            + failing_rank[run]
            + re.escape(
                " was writing). The earlier checkpoints are intact; the partial files of this attempt were removed."
            )
        )
        for rank, error in enumerate(result["errors"]):
            assert error is not None, f"{run}: rank {rank} raised nothing"
            assert error["is_save_error"] and error["errno"] == 28, (run, rank, error)
            assert re.fullmatch(expected, error["message"]), (run, rank, error["message"])
        # No staging left behind; the step-2 checkpoint and last.ckpt (from step 2) load and resume.
        assert result["files"] == ["epoch=0-step=2.ckpt", "last.ckpt"], (run, result["files"])
        assert (result["started_at"], result["global_step"]) == (2, 8), run


def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    # The disk fills up on rank 0 for full files (which only it writes), on rank 1 for shards; sync and async.
    args = ["--scenarios", "disk_full", "--runs", FAILING_RUNS, "--room", "2000", "--checkpoint-dir", str(tmp_path)]
    results = save_worker(tmp_path, args, nproc=2)
    failing = {run: "0" if "full" in run else "1" for run in FAILING_RUNS.split(",")}
    assert_failed_on_every_rank_and_resumable(results["disk_full"], tmp_path, failing_rank=failing)


def test_a_real_full_filesystem_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 3 MB tmpfs here ({mounted.stderr.strip()}); needs root or CAP_SYS_ADMIN")
    try:
        args = ["--scenarios", "tmpfs", "--runs", FAILING_RUNS, "--room", "2000", "--checkpoint-dir", str(disk)]
        results = save_worker(tmp_path, args, nproc=2)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    # Both ranks write shards to the same full disk: either may be the first to fail.
    failing = {run: "0" if "full" in run else "[01]" for run in FAILING_RUNS.split(",")}
    assert_failed_on_every_rank_and_resumable(results["tmpfs"], disk, failing_rank=failing)
