"""Checkpoint formats as classes: which one a saved checkpoint has, how a new one registers, and each one's resume
into a module built without values (the state it leaves for after sharding), against the same resume of a module
built eagerly."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import lightning as L
import pytest
import torch
from torch import nn

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.checkpoint import formats, storage, writing
from fsdp_strategy.checkpoint.formats import FullFormat, SavedFormat, ShardedFormat, format_named, saved_format
from fsdp_strategy.checkpoint.location import Location
from testkit import full
from testkit.callbacks import StartState
from testkit.models import TinyLM, token_loader


@pytest.fixture
def memory_dir() -> Iterator[str]:
    url = f"memory://formats-{uuid.uuid4().hex[:8]}"
    yield url
    storage.remove_data(url)


def tiny_checkpoint() -> dict:
    return {"state_dict": nn.Linear(2, 2).state_dict(), "epoch": 0}


def test_the_saved_format_is_told_by_what_is_at_the_path(single_rank_group, tmp_path, memory_dir) -> None:
    file = tmp_path / "one.ckpt"
    torch.save(tiny_checkpoint(), file)
    directory = tmp_path / "sharded.ckpt"
    writing.save_sharded(directory, tiny_checkpoint(), is_rank_zero=True)
    staging = writing.staging_path(f"{memory_dir}/sharded.ckpt", "token")
    writing.save_sharded(staging, tiny_checkpoint(), is_rank_zero=True)
    writing.publish(staging, f"{memory_dir}/sharded.ckpt")

    assert saved_format(file) is FullFormat and saved_format(tmp_path / "missing.ckpt") is FullFormat
    assert saved_format(directory) is ShardedFormat and saved_format(f"{memory_dir}/sharded.ckpt") is ShardedFormat
    assert format_named("sharded") is ShardedFormat and format_named("full") is FullFormat


def test_a_new_format_is_one_subclass_registered_before_the_full_one(monkeypatch, tmp_path) -> None:
    class AdapterFormat(FullFormat):
        name = "adapter"

        @classmethod
        def holds(cls, where: Location) -> bool:
            return where.name.endswith(".adapter")

    monkeypatch.setattr(formats, "FORMATS", (ShardedFormat, AdapterFormat, FullFormat))
    assert saved_format(tmp_path / "lora.adapter") is AdapterFormat and format_named("adapter") is AdapterFormat
    assert saved_format(tmp_path / "model.ckpt") is FullFormat
    with pytest.raises(TypeError, match="abstract"):
        type("Unfinished", (SavedFormat,), {"name": "unfinished", "single_file": True})(strategy=None)


def resume(tmp_path, path, *, empty_init: bool) -> StartState:  # type: ignore[no-untyped-def]
    start = StartState()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="fsdp2",
        max_steps=3,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[start],
    )
    torch.manual_seed(1)  # other values than the checkpoint's: the resume must replace them
    with trainer.init_module(empty_init=empty_init):
        model = TinyLM()
    trainer.fit(model, token_loader(batch_size=4, samples=16), ckpt_path=path)
    return start


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_module_built_without_values_resumes_as_one_built_eagerly(trainer_env, tmp_path, kind) -> None:
    torch.manual_seed(0)
    first = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(state_dict_type=kind),
        max_steps=2,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyLM()
    first.fit(model, token_loader(batch_size=4, samples=16))
    saved = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    path = tmp_path / "saved.ckpt"
    first.save_checkpoint(path)
    assert saved_format(path) is format_named(kind)

    trainer_env.fresh()
    eager = resume(tmp_path, path, empty_init=False)
    trainer_env.fresh()
    deferred = resume(tmp_path, path, empty_init=True)

    assert eager.params.keys() == deferred.params.keys() == saved.keys()
    assert all(torch.equal(eager.params[name], saved[name]) for name in saved)
    assert all(torch.equal(deferred.params[name], saved[name]) for name in saved)
    assert eager.optimizer.keys() == deferred.optimizer.keys()
    for name, entries in eager.optimizer.items():
        assert entries.keys() == deferred.optimizer[name].keys() and entries, name
        assert all(torch.equal(deferred.optimizer[name][key], value) for key, value in entries.items()), name
