"""Sharded checkpoints on S3 (moto's S3 server on 127.0.0.1, started by the test) during a 2-rank fit,
compared with the same run on local disk; a rank killed while a checkpoint is written, and while it is published."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fsdp_strategy import consolidate_checkpoint
from fsdp_strategy.checkpoint import storage, verify
from integration_tests.conftest import max_relative_difference, torchrun
from testkit.s3 import s3_server

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


def _listing(url: str) -> tuple[list[str], list[str]]:
    """The checkpoint names under ``url`` and its hidden shard prefixes."""
    fs, root = storage.filesystem(url)
    fs.invalidate_cache()
    names = sorted(entry.rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False))
    return [n for n in names if not n.startswith(".")], [n for n in names if n.startswith(storage.DATA_PREFIX)]


def test_on_s3_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable_and_the_resume_matches_local_disk(
    tmp_path: Path, s3_bucket: str
) -> None:
    # Saves every 4 steps: step=4, last (step 4), step=8, last (step 8), ... torchrun restarts both ranks with
    # ckpt_path="last" after the kill. "publish": rank 0 dies while last.ckpt (step 8) is published, after every
    # shard of it was written. "save": rank 1 dies as the step=8 save begins (rank 0 is in it).
    runs = {
        "local": (str(tmp_path / "local"), ()),
        "publish": (f"{s3_bucket}/publish", ("--kill-in-publish", "4")),
        "save": (f"{s3_bucket}/save", ("--kill-in-save", "3")),
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {
            name: pool.submit(_elastic_run, tmp_path, name, where, *extra) for name, (where, extra) in runs.items()
        }
        results = {name: future.result() for name, future in futures.items()}

    local = results["local"]
    assert (local["attempt"], local["started_at_step"], local["global_step"]) == (0, 0, 12)
    for name in ("publish", "save"):
        result = results[name]
        assert (tmp_path / f"{name}.killed").exists(), f"{name}: the rank was never killed"
        # The step-4 last.ckpt was still complete under its name, and "last" was found on S3.
        assert (result["attempt"], result["started_at_step"], result["global_step"]) == (1, 4, 12), name
        assert max_relative_difference(result["params"], local["params"]) <= 1e-6, name

    # As Lightning names them on any store: the resumed "publish" run found epoch=1-step=8.ckpt taken, hence -v1.
    expected = {
        "publish": [
            "epoch=0-step=4.ckpt",
            "epoch=1-step=8-v1.ckpt",
            "epoch=1-step=8.ckpt",
            "epoch=2-step=12.ckpt",
            "last.ckpt",
        ],
        "save": ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"],
    }
    for name, names in expected.items():
        remote = runs[name][0]
        visible, prefixes = _listing(remote)
        assert visible == names, name
        for checkpoint in visible:
            verify.verify_sharded_checkpoint(f"{remote}/{checkpoint}")  # every name is a complete checkpoint
        # One shard prefix per checkpoint: the killed save's prefix was removed by the restarted attempt.
        assert len(prefixes) == len(visible), (name, prefixes)

    remote = runs["publish"][0]
    consolidated = consolidate_checkpoint(f"{remote}/last.ckpt", tmp_path / "last.ckpt", progress=False)
    state = torch.load(consolidated)["state_dict"]
    params = results["publish"]["params"]
    assert max_relative_difference({k: state[k].float() for k in params}, params) == 0
