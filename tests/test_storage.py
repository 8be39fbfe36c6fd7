"""Checkpoints on fsspec URLs (``memory://``, ``file://``) with an in-process 1-rank Trainer: published by a
manifest written last, found by ``ckpt_path="last"``, removed by top-k, checked and consolidated."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fsdp_strategy import (
    CheckpointError,
    FSDP2Strategy,
    consolidate_checkpoint,
    export_safetensors,
)
from fsdp_strategy.checkpoint import storage, verify
from fsdp_strategy.checkpoint.resume_last import find_last
from fsdp_strategy.checkpoint.staging import remove_stale_staging, staging_token
from testkit.models import TinyLM, token_loader


@pytest.fixture
def memory_dir() -> Iterator[str]:
    url = f"memory://run-{uuid.uuid4().hex[:8]}"
    yield url
    storage.remove_data(url)


class Progress(TinyLM):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("progress", float(self.global_step))
        return super().training_step(batch, batch_idx)


def fit(directory: str, *, steps: int, kind: str, ckpt_path: str | None = None, **strategy: object) -> L.Trainer:
    checkpoints = ModelCheckpoint(
        dirpath=directory, every_n_train_steps=2, save_top_k=2, monitor="progress", mode="max", save_last=True
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(state_dict_type=kind, **strategy),  # type: ignore[arg-type]
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
    )
    torch.manual_seed(0)
    trainer.fit(Progress(), token_loader(batch_size=4, samples=16), ckpt_path=ckpt_path)
    return trainer


def listing(url: str) -> list[str]:
    fs, root = storage.filesystem(url)
    return sorted(entry.rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False))


def test_urls_are_told_from_local_paths() -> None:
    assert storage.is_url("s3://bucket/run/last.ckpt") and storage.is_url("memory://x")
    assert not storage.is_url("/tmp/x") and not storage.is_url("file:///tmp/x") and not storage.is_url("relative/x")
    assert not storage.is_url(Path("s3://bucket/x"))  # a Path has collapsed the URL already
    assert storage.location("file:///tmp/x.ckpt") == Path("/tmp/x.ckpt")
    assert storage.location("s3://bucket/x.ckpt") == "s3://bucket/x.ckpt"


@pytest.mark.parametrize(
    ("kind", "async_save"), [("sharded", False), ("full", False), ("sharded", True), ("full", True)]
)
def test_top_k_and_last_on_a_url_resume_from_last_and_leave_one_shard_prefix_per_checkpoint(
    trainer_env, memory_dir, kind, async_save
):
    fit(memory_dir, steps=6, kind=kind, async_save=async_save)
    names = listing(memory_dir)
    visible = [n for n in names if not n.startswith(".")]
    # Saved at steps 2, 4, 6; top 2 kept, the step-2 one removed.
    assert visible == ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    prefixes = [n for n in names if n.startswith(storage.DATA_PREFIX)]
    assert len(prefixes) == (3 if kind == "sharded" else 0), names
    for name in visible:
        assert verify.is_sharded_checkpoint(f"{memory_dir}/{name}") == (kind == "sharded")

    trainer_env.fresh()
    resumed = fit(memory_dir, steps=8, kind=kind, ckpt_path="last", async_save=async_save)
    assert resumed.ckpt_path == f"{memory_dir}/last.ckpt"
    assert resumed.global_step == 8
    assert [n for n in listing(memory_dir) if not n.startswith(".")] == [
        "epoch=1-step=6.ckpt",
        "epoch=1-step=8.ckpt",
        "last.ckpt",
    ]


def test_a_remote_checkpoint_is_checked_loaded_consolidated_and_exported_through_its_manifest(
    trainer_env, memory_dir, tmp_path
):
    trainer = fit(memory_dir, steps=2, kind="sharded")
    url = f"{memory_dir}/last.ckpt"
    manifest = storage.read_manifest(url)
    assert manifest is not None and manifest["data"].startswith(storage.DATA_PREFIX)
    out = consolidate_checkpoint(url, tmp_path / "one.ckpt", progress=False)
    saved = torch.load(out)
    assert saved["global_step"] == 2
    params = trainer.lightning_module.state_dict()
    assert all(torch.equal(saved["state_dict"][k], params[k]) for k in params)
    from safetensors.torch import load_file

    exported = export_safetensors(url, tmp_path / "hf", progress=False)
    weights = load_file(exported.path / "model.safetensors")
    assert weights.keys() == params.keys() and all(torch.equal(weights[k], params[k]) for k in params)

    # A shard file lost from the prefix the manifest names: the error names the checkpoint's URL and the file.
    fs, data = storage.filesystem(storage.data_url(url, manifest))
    fs.rm(f"{data}/__0_0.distcp")
    with pytest.raises(CheckpointError, match=rf"Checkpoint '{url}' is damaged: shard file '__0_0.distcp' is missing"):
        verify.verify_sharded_checkpoint(url)


def test_save_checkpoint_to_a_url_and_fit_from_that_url(trainer_env, memory_dir):
    trainer = fit(memory_dir, steps=2, kind="sharded")
    url = f"{memory_dir}/explicit.ckpt"
    trainer.save_checkpoint(url)
    assert storage.read_manifest(url) is not None and not Path("memory:").exists()
    saved = {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}

    trainer_env.fresh()
    resumed = fit(f"{memory_dir}/resumed", steps=2, kind="sharded", ckpt_path=url)
    assert resumed.ckpt_path == url and resumed.global_step == 2  # restored at step 2: no step left to train
    params = resumed.lightning_module.state_dict()
    assert all(torch.equal(params[k], saved[k]) for k in saved)


def test_a_half_written_remote_checkpoint_is_invisible_and_its_prefix_is_removed_once_its_writer_is_gone(
    trainer_env, memory_dir
):
    fit(memory_dir, steps=2, kind="sharded")
    # What a writer killed before its manifest leaves: shards under a prefix that no name points to.
    dead = staging_token().split("-")
    dead[1] = "999999999"  # no such process
    orphan = storage.join(memory_dir, storage.DATA_PREFIX + "-".join(dead))
    fs, root = storage.filesystem(orphan)
    fs.pipe(f"{root}/__0_0.distcp", b"x" * 10)
    assert find_last([ModelCheckpoint(dirpath=memory_dir)]) == f"{memory_dir}/last.ckpt"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        storage.read_manifest(f"{memory_dir}/epoch=0-step=4.ckpt")

    import fsdp_strategy.checkpoint.staging as staging

    kept = remove_stale_staging(memory_dir)  # written after this process started: maybe a save in progress
    assert kept == [] and fs.exists(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(staging, "_PROCESS_START", float("inf"))  # as if this process had started after the write
        assert remove_stale_staging(memory_dir) == [orphan]
    assert not fs.exists(root)
    # The published checkpoints' prefixes stay.
    assert len([n for n in listing(memory_dir) if n.startswith(storage.DATA_PREFIX)]) == 2


def test_a_file_url_is_a_local_path_and_init_weights_read_from_a_url(trainer_env, memory_dir, tmp_path):
    trainer = fit(memory_dir, steps=2, kind="full")
    trainer.save_checkpoint(f"file://{tmp_path}/local.ckpt")
    assert (tmp_path / "local.ckpt").is_file() and not Path("file:").exists()

    trainer_env.fresh()
    started = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(init_weights=f"{memory_dir}/last.ckpt"),
        max_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = TinyLM()
    started.fit(module, token_loader(batch_size=4, samples=16))
    expected = torch.load(tmp_path / "local.ckpt")["state_dict"]
    assert all(torch.equal(module.state_dict()[k], expected[k]) for k in expected)
