"""Save and resume on real multi-process CPU runs: exact resume, resharding, interop with DDP, async."""

from __future__ import annotations

import json
from pathlib import Path

from integration_tests.conftest import max_relative_difference, torchrun


def checkpoint_args(directory: Path, runs: str, variant: str = "adamw_scheduler") -> list[str]:
    return ["--strategies", runs, "--variants", variant, "--max-steps", "8", "--checkpoint-dir", str(directory)]


def assert_matches(results: dict, run: str, reference: str, variant: str = "adamw_scheduler") -> None:
    difference = max_relative_difference(
        results[f"{run}/{variant}"]["params"], results[f"{reference}/{variant}"]["params"]
    )
    assert difference <= 1e-5, f"{run} vs {reference}: {difference}"


def test_resume_reshard_and_interop_from_two_ranks(run_worker, tmp_path: Path) -> None:
    # 8 steps on 2 ranks, saved as: sharded (fsdp2), background-written sharded (fsdp2_async),
    # one full file from fsdp2 (fsdp2_full), and DDP's own file.
    run_worker(checkpoint_args(tmp_path, "fsdp2,fsdp2_async,fsdp2_full,ddp"), nproc=2)
    assert (tmp_path / "fsdp2.ckpt" / "meta.pt").is_file() and (tmp_path / "fsdp2.ckpt" / ".metadata").is_file()
    assert (tmp_path / "fsdp2_async.ckpt" / ".metadata").is_file() and (tmp_path / "fsdp2_full.ckpt").is_file()
    assert not list(tmp_path.glob(".partial-*")), "a staging directory was left behind"

    # ... resumed to 16 steps on 2 ranks: exact resume, and checkpoints crossing between DDP and FSDP2.
    runs = "ddp:ddp,fsdp2:fsdp2,fsdp2:fsdp2_async,fsdp2:ddp,ddp:fsdp2_full,ddp_initw,fsdp2_initw"
    same = run_worker(checkpoint_args(tmp_path, runs), nproc=2)
    for run in ("fsdp2:fsdp2", "fsdp2:fsdp2_async", "fsdp2:ddp", "ddp:fsdp2_full"):
        assert_matches(same, run, "ddp:ddp")
    # Full weights read by rank 0 only, then a fresh optimizer: as DDP started from the same weights.
    assert_matches(same, "fsdp2_initw", "ddp_initw")
    assert len(same["fsdp2:fsdp2/adamw_scheduler"]["losses"]) == 8, "the resumed run must continue from step 8"

    # ... resumed on 1 and on 4 ranks, and on a (replicate, shard) = (2, 2) mesh.
    one = run_worker(checkpoint_args(tmp_path, "ddp:ddp,fsdp2:fsdp2"), nproc=1)
    assert_matches(one, "fsdp2:fsdp2", "ddp:ddp")
    four = run_worker(checkpoint_args(tmp_path, "ddp:ddp,fsdp2:fsdp2,fsdp2_replicate2:fsdp2"), nproc=4)
    assert_matches(four, "fsdp2:fsdp2", "ddp:ddp")
    assert_matches(four, "fsdp2_replicate2:fsdp2", "ddp:ddp")


def test_resume_from_one_rank_on_two_and_from_hybrid_to_full_sharding(run_worker, tmp_path: Path) -> None:
    run_worker(checkpoint_args(tmp_path / "one", "fsdp2,ddp"), nproc=1)
    two = run_worker(checkpoint_args(tmp_path / "one", "ddp:ddp,fsdp2:fsdp2"), nproc=2)
    assert_matches(two, "fsdp2:fsdp2", "ddp:ddp")

    four = run_worker(
        checkpoint_args(tmp_path / "four", "fsdp2_replicate2,ddp,fsdp2:fsdp2_replicate2,ddp:ddp"), nproc=4
    )
    assert_matches(four, "fsdp2:fsdp2_replicate2", "ddp:ddp")


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoints_loadable(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    # Saves: step=2, last, step=4, last, then death inside the save of step=6 (all shards written, not renamed).
    crashed = torchrun(
        "integration_tests.crash_worker",
        ["--checkpoint-dir", str(directory), "--die-in-save", "5", "--out", str(tmp_path / "crashed.json")],
        nproc=2,
        cwd=tmp_path,
        check=False,
    )
    assert crashed.returncode != 0
    visible = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    assert visible == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    partial = [p.name for p in directory.iterdir() if p.name.startswith(".")]
    assert len(partial) == 1 and "last" not in partial[0], partial

    torchrun(
        "integration_tests.crash_worker",
        ["--checkpoint-dir", str(directory), "--resume", "--out", str(tmp_path / "resumed.json")],
        nproc=2,
        cwd=tmp_path,
    )
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed == {"global_step": 8, "started_at": 4}
    # The resumed run's first save removed the staging that the killed writer left.
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]
