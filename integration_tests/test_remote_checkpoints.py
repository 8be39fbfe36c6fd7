"""Sharded checkpoints on S3 (moto's S3 server on 127.0.0.1, started by the test) during a 2-rank fit,
compared with the same run on local disk; a rank killed while a checkpoint is published."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fsdp_strategy import consolidate_checkpoint, storage, verify
from fsdp_strategy.testing.s3 import s3_server
from integration_tests.conftest import max_relative_difference, torchrun

WORKER = "integration_tests.recovery_worker"


@pytest.fixture
def s3_bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with s3_server(bucket="checkpoints") as env:
        for name, value in env.items():
            monkeypatch.setenv(name, value)  # the workers inherit them: integration_tests.conftest._environment
        yield "s3://checkpoints"


def _elastic_run(tmp_path: Path, name: str, directory: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.pt"
    torchrun(WORKER, ["--checkpoint-dir", directory, "--out", str(out), *extra], nproc=2, cwd=tmp_path, max_restarts=1)
    return torch.load(out)


def test_on_s3_a_rank_killed_while_publishing_last_leaves_it_loadable_and_the_resume_matches_local_disk(
    tmp_path: Path, s3_bucket: str
) -> None:
    remote = f"{s3_bucket}/run"
    # Saves every 4 steps: step=4, last (step 4), step=8, then rank 0 dies while last.ckpt (step 8) is
    # published, after every shard of it was written. torchrun restarts both ranks with ckpt_path="last".
    runs = {"local": (str(tmp_path / "local"), ()), "s3": (remote, ("--kill-in-publish", "4"))}
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(_elastic_run, tmp_path, name, where, *extra) for name, (where, extra) in runs.items()}
        results = {name: future.result() for name, future in futures.items()}

    local, s3 = results["local"], results["s3"]
    assert (local["attempt"], local["started_at_step"], local["global_step"]) == (0, 0, 12)
    assert (tmp_path / "s3.killed").exists(), "rank 0 was never killed"
    # The replaced last.ckpt was still the complete step-4 checkpoint, and "last" was found on S3.
    assert (s3["attempt"], s3["started_at_step"], s3["global_step"]) == (1, 4, 12)
    assert max_relative_difference(s3["params"], local["params"]) <= 1e-6

    fs, root = storage.filesystem(remote)
    fs.invalidate_cache()
    names = sorted(entry.rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False))
    visible = [name for name in names if not name.startswith(".")]
    # As Lightning names them on any store: the resumed run found epoch=1-step=8.ckpt taken, hence -v1.
    assert visible == ["epoch=0-step=4.ckpt", "epoch=1-step=8-v1.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
    for name in visible:
        verify.verify_sharded_checkpoint(f"{remote}/{name}")  # every name is a complete checkpoint
    # One shard prefix per checkpoint: the killed save's prefix was removed by the restarted attempt.
    assert len([name for name in names if name.startswith(storage.DATA_PREFIX)]) == len(visible), names

    consolidated = consolidate_checkpoint(f"{remote}/last.ckpt", tmp_path / "last.ckpt", progress=False)
    state = torch.load(consolidated)["state_dict"]
    assert max_relative_difference({k: state[k].float() for k in s3["params"]}, s3["params"]) == 0
