"""Adapter checkpoints (``state_dict_type="adapter"``) on a real 1-rank group: only what training changes is saved,
a resume from one starts where a resume from a sharded checkpoint of the same run starts, and a resume onto another
base than the one trained on is refused, naming both."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import lightning as L
import pytest
import torch

from fsdp_strategy import CheckpointError, FSDP2Strategy
from fsdp_strategy.checkpoint import storage
from fsdp_strategy.checkpoint.dcp_metadata import read_dcp_metadata
from fsdp_strategy.checkpoint.formats import AdapterFormat, saved_format
from fsdp_strategy.checkpoint.storage import checkpoint_files
from testkit.callbacks import StartState
from testkit.hf import TINY_LLAMA, PretrainedLlama, save_tiny_llama
from testkit.models import TinyLM, token_loader

FROZEN = ("embed.weight", "head.weight", "blocks.0.")  # the tied embedding and the first block


class FrozenBaseLM(TinyLM):
    """A fine-tuning recipe's module: the embedding (tied to the head) and the first block frozen."""

    def __init__(self, freeze: bool = True) -> None:
        super().__init__()
        if freeze:
            self.embed.requires_grad_(False)
            self.blocks[0].requires_grad_(False)


def trainer(root: Path, strategy: FSDP2Strategy, *, steps: int, callbacks: list | None = None) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def train_and_save(
    root: Path,
    kind: str,
    *,
    freeze: bool = True,
    init_weights: str | None = None,
    path: Path | str | None = None,
    async_save: bool = False,
) -> Path | str:
    torch.manual_seed(0)
    model = FrozenBaseLM(freeze)
    strategy = FSDP2Strategy(state_dict_type=kind, init_weights=init_weights, async_save=async_save)
    fit = trainer(root, strategy, steps=2)
    fit.fit(model, token_loader(batch_size=4, samples=16))
    path = root / f"{kind}.ckpt" if path is None else path
    fit.save_checkpoint(path)
    strategy.wait_for_checkpoint()
    return path


def resume(
    root: Path, path: Path | str, *, seed: int = 0, init_weights: str | None = None, empty_init: bool = False
) -> StartState:
    start = StartState()
    fit = trainer(root, FSDP2Strategy(init_weights=init_weights), steps=3, callbacks=[start])
    torch.manual_seed(seed)  # seed 0 builds the base the run was trained on
    with fit.init_module(empty_init=empty_init):
        model = FrozenBaseLM()
    fit.fit(model, token_loader(batch_size=4, samples=16), ckpt_path=path)
    return start


def saved_model_keys(path: Path) -> set[str]:
    keys = read_dcp_metadata(checkpoint_files(path)).state_dict_metadata
    return {key.removeprefix("model.") for key in keys if key.startswith("model.")}


def assert_same_start(mine: StartState, theirs: StartState) -> None:
    assert mine.params.keys() == theirs.params.keys()
    assert all(torch.equal(mine.params[name], theirs.params[name]) for name in theirs.params), "parameters"
    assert mine.optimizer.keys() == theirs.optimizer.keys() and mine.optimizer
    for name, entries in theirs.optimizer.items():
        assert all(torch.equal(mine.optimizer[name][key], value) for key, value in entries.items()), name


def test_an_adapter_checkpoint_leaves_out_the_frozen_parameters_and_resumes_as_a_sharded_one(
    trainer_env, tmp_path
) -> None:
    adapter = train_and_save(tmp_path, "adapter")
    trainer_env.fresh()
    sharded = train_and_save(tmp_path, "sharded")

    assert saved_format(adapter) is AdapterFormat and saved_format(sharded) is not AdapterFormat
    left_out = saved_model_keys(sharded) - saved_model_keys(adapter)
    assert left_out and all(key.startswith(FROZEN) for key in left_out)
    record = json.loads((adapter / "adapter.json").read_text())
    assert set(record["frozen"]) == left_out and record["init_weights"] is None
    torch.manual_seed(0)
    embed = FrozenBaseLM().embed.weight.detach().double()
    saved = record["frozen"]["embed.weight"]
    assert (saved["shape"], saved["dtype"]) == (list(embed.shape), "float32")
    assert (saved["sum"], saved["sum_of_squares"]) == (float(embed.sum()), float((embed * embed).sum()))
    size = lambda path: sum(f.stat().st_size for f in path.iterdir())  # noqa: E731
    assert size(adapter) < size(sharded)

    trainer_env.fresh()
    from_adapter = resume(tmp_path, adapter)
    trainer_env.fresh()
    from_sharded = resume(tmp_path, sharded)
    assert_same_start(from_adapter, from_sharded)


def test_a_resume_from_an_adapter_checkpoint_is_a_resume_from_a_full_one(trainer_env, tmp_path) -> None:
    adapter = train_and_save(tmp_path, "adapter")
    trainer_env.fresh()
    one_file = train_and_save(tmp_path, "full")
    trainer_env.fresh()
    from_adapter = resume(tmp_path, adapter)
    trainer_env.fresh()
    assert_same_start(from_adapter, resume(tmp_path, one_file))


def test_a_module_built_without_values_resumes_from_an_adapter_checkpoint_with_its_base_as_init_weights(
    trainer_env, tmp_path
) -> None:
    base = tmp_path / "base.pt"
    torch.manual_seed(5)
    torch.save(FrozenBaseLM().state_dict(), base)
    adapter = train_and_save(tmp_path, "adapter", init_weights=str(base))
    trainer_env.fresh()
    eager = resume(tmp_path, adapter, init_weights=str(base))
    trainer_env.fresh()
    assert_same_start(resume(tmp_path, adapter, init_weights=str(base), empty_init=True), eager)

    # Without them its frozen parameters would get new random values at materialization, not the base's.
    without = train_and_save(tmp_path, "adapter", path=tmp_path / "without.ckpt")
    trainer_env.fresh()
    with pytest.raises(
        CheckpointError,
        match=r"had other values than the module built for this resume has .*"
        r"built without values, with `meta_init` or `init_module\(empty_init=True\)`, draws new",
    ):
        resume(tmp_path, without, empty_init=True)


def test_the_frozen_parameters_come_from_init_weights_checked_by_content(trainer_env, tmp_path) -> None:
    torch.manual_seed(5)
    base = tmp_path / "base.pt"
    torch.save(FrozenBaseLM().state_dict(), base)
    adapter = train_and_save(tmp_path, "adapter", init_weights=str(base))
    record = json.loads((adapter / "adapter.json").read_text())
    assert record["init_weights"]["path"] == str(base) and len(record["init_weights"]["sha256"]) == 64
    trainer_env.fresh()
    sharded = train_and_save(tmp_path, "sharded", init_weights=str(base))

    trainer_env.fresh()
    from_adapter = resume(tmp_path, adapter, seed=1, init_weights=str(base))  # built with other values than the base
    trainer_env.fresh()
    from_sharded = resume(tmp_path, sharded, seed=1)
    assert_same_start(from_adapter, from_sharded)

    other = tmp_path / "other.pt"
    torch.manual_seed(6)
    torch.save(FrozenBaseLM().state_dict(), other)  # the same names and shapes, other values
    trainer_env.fresh()
    with pytest.raises(CheckpointError) as refused:
        resume(tmp_path, adapter, init_weights=str(other))
    assert f"The adapter checkpoint '{adapter}' was trained on `init_weights` '{base}' (sha256 " in str(refused.value)
    assert f"this run's `init_weights` is '{other}' (sha256 " in str(refused.value)
    trainer_env.fresh()
    with pytest.raises(CheckpointError, match=r"this run's `init_weights` is none\. .*pass `init_weights`"):
        resume(tmp_path, adapter)


def test_a_module_of_another_base_is_refused_naming_the_parameter(trainer_env, tmp_path) -> None:
    adapter = train_and_save(tmp_path, "adapter")
    record = json.loads((adapter / "adapter.json").read_text())
    record["frozen"]["embed.weight"]["shape"] = [3, 4]
    (adapter / "adapter.json").write_text(json.dumps(record))
    trainer_env.fresh()
    with pytest.raises(CheckpointError, match=r"frozen parameter 'embed\.weight' had shape \(3, 4\); it has shape"):
        resume(tmp_path, adapter)

    record["frozen"]["embed.weight"]["shape"] = list(FrozenBaseLM().embed.weight.shape)
    (adapter / "adapter.json").write_text(json.dumps(record))
    trainer_env.fresh()
    with pytest.raises(CheckpointError) as refused:
        resume(tmp_path, adapter, seed=1)  # the same shapes, other values
    assert f"The adapter checkpoint '{adapter}' was trained on a base whose frozen parameter " in str(refused.value)
    assert "had other values than the module built for this resume has" in str(refused.value)

    (adapter / "adapter.json").write_text("{not json")
    trainer_env.fresh()
    with pytest.raises(CheckpointError, match=r"is damaged: 'adapter\.json' is not the record of an adapter"):
        resume(tmp_path, adapter)


def test_without_frozen_parameters_an_adapter_checkpoint_holds_every_parameter(trainer_env, tmp_path) -> None:
    adapter = train_and_save(tmp_path, "adapter", freeze=False)
    trainer_env.fresh()
    sharded = train_and_save(tmp_path, "sharded", freeze=False)
    assert saved_model_keys(adapter) == saved_model_keys(sharded)
    assert json.loads((adapter / "adapter.json").read_text())["frozen"] == {}


def test_an_adapter_checkpoint_saved_to_a_url_in_the_background_resumes_as_a_sharded_one(trainer_env, tmp_path) -> None:
    url = f"memory://adapter-{uuid.uuid4().hex[:8]}/adapter.ckpt"
    try:
        train_and_save(tmp_path, "adapter", path=url, async_save=True)
        assert saved_format(url) is AdapterFormat
        trainer_env.fresh()
        sharded = train_and_save(tmp_path, "sharded")
        trainer_env.fresh()
        from_url = resume(tmp_path, url)
        trainer_env.fresh()
        assert_same_start(from_url, resume(tmp_path, sharded))
    finally:
        storage.remove_data(url)


def test_the_first_save_says_what_adapter_checkpoints_hold(trainer_env, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    train_and_save(tmp_path, "adapter")
    module = FrozenBaseLM()
    total = sum(p.numel() for p in module.parameters())
    kept = sum(p.numel() for p in module.parameters() if p.requires_grad)
    told = f"adapter checkpoints hold {kept:,} of the {total:,} parameters ({kept / total:.2%}) and their optimizer"
    assert told in caplog.text


class FrozenEmbeddingLlama(PretrainedLlama):
    """A Hugging Face Llama built from its config, its embedding frozen: the base comes from ``init_weights``."""

    def configure_model(self) -> None:
        super().configure_model()
        self.model.model.embed_tokens.requires_grad_(False)


def test_a_hugging_face_weights_directory_as_init_weights_is_recorded_by_its_files_content(
    trainer_env, tmp_path
) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    base, other = save_tiny_llama(str(tmp_path / "base")), save_tiny_llama(str(tmp_path / "other"), seed=1)
    config = LlamaConfig(**TINY_LLAMA).to_dict()
    data = token_loader(batch_size=4, samples=16)
    trained = FrozenEmbeddingLlama(config)
    fit = trainer(tmp_path, FSDP2Strategy(state_dict_type="adapter", init_weights=base, meta_init=True), steps=2)
    fit.fit(trained, data)
    fit.save_checkpoint(tmp_path / "adapter.ckpt")
    record = json.loads((tmp_path / "adapter.ckpt" / "adapter.json").read_text())
    assert record["init_weights"]["path"] == base and len(record["init_weights"]["sha256"]) == 64
    assert "model.model.embed_tokens.weight" in record["frozen"]

    def resume_on(weights: str) -> StartState:
        trainer_env.fresh()
        start = StartState()
        strategy = FSDP2Strategy(init_weights=weights, meta_init=True)
        trainer(tmp_path, strategy, steps=3, callbacks=[start]).fit(
            FrozenEmbeddingLlama(config), data, ckpt_path=tmp_path / "adapter.ckpt"
        )
        return start

    start = resume_on(base)
    assert all(torch.equal(start.params[name], p) for name, p in trained.named_parameters()), "parameters"
    with pytest.raises(CheckpointError) as refused:
        resume_on(other)  # the same names and shapes, other values
    assert f"was trained on `init_weights` '{base}' (sha256 {record['init_weights']['sha256']})" in str(refused.value)
    assert f"this run's `init_weights` is '{other}' (sha256 " in str(refused.value)
