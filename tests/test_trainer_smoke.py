"""In-process ``Trainer(strategy="fsdp2", devices=1)`` on CPU: fit, validate, meta init, configure_model,
sharded and full checkpoint save and resume. A few steps each; the real multi-process runs live in integration_tests/."""

from __future__ import annotations

import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.checkpoint.verify import is_sharded_checkpoint
from testkit import full
from testkit.models import VOCAB, WIDTH, Block, TinyLM, token_loader


def trainer(tmp_path, **kwargs) -> L.Trainer:
    kwargs.setdefault("strategy", "fsdp2")
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        **kwargs,
    )


def loader():
    return token_loader(batch_size=4, samples=16)


def assert_sharded_and_finite(module: nn.Module) -> None:
    """Every parameter is a materialized, finite DTensor."""
    for name, param in module.named_parameters():
        assert isinstance(param, DTensor), name
        assert not param.is_meta and not param.to_local().is_meta, name
        assert torch.isfinite(full(param)).all(), name


def assert_plain_and_finite(module: nn.Module) -> None:
    """After a stage the module is the plain one the user built, as DDP leaves it."""
    assert not any(isinstance(m, FSDPModule) for m in module.modules())
    for name, param in module.named_parameters():
        assert type(param) is nn.Parameter and not param.is_meta, name
        assert torch.isfinite(param).all(), name


class SeenWhileTraining(L.Callback):
    """Checks inside fit, where the module is sharded, by calling ``check(module)`` at the end of training."""

    def __init__(self, check) -> None:
        self.check, self.ran = check, False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(pl_module)
        self.ran = True


class TinyLMWithReset(TinyLM):
    """Initializes its own parameter when materialized from the meta device."""

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_fit_and_validate_a_meta_initialized_model(trainer_env, tmp_path, precision):
    def sharded(model: L.LightningModule) -> None:
        assert isinstance(model, FSDPModule)
        assert all(isinstance(block, FSDPModule) for block in model.blocks)
        assert isinstance(model.blocks[0].norm, FSDPModule) is (precision == "bf16-mixed")  # fp32 norm units
        assert_sharded_and_finite(model)
        assert model.head.weight is model.embed.weight

    seen = SeenWhileTraining(sharded)
    fit_trainer = trainer(tmp_path, max_steps=3, precision=precision, callbacks=[seen])
    with fit_trainer.init_module(empty_init=True):
        model = TinyLMWithReset()
    assert model.embed.weight.is_meta

    fit_trainer.fit(model, loader(), loader())

    assert seen.ran and fit_trainer.global_step == 3
    assert math.isfinite(fit_trainer.callback_metrics["train_loss"].item())
    assert_plain_and_finite(model)
    assert model.head.weight is model.embed.weight
    assert fit_trainer.strategy.device_mesh.mesh_dim_names == ("dp_shard",)
    assert model.device_mesh is fit_trainer.strategy.device_mesh

    (metrics,) = fit_trainer.validate(model, loader(), verbose=False)
    assert math.isfinite(metrics["val_loss"])
    assert fit_trainer.strategy.model is model
    assert_plain_and_finite(model)


class Gain(nn.Module):
    """Owns a parameter created with its values and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((2,), 3.0))


class BuiltInConfigureModel(L.LightningModule):
    """Creates its layers in configure_model(), where the device mesh is already available."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, object] = {}

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.seen["mesh_dims"] = self.device_mesh.mesh_dim_names
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.blocks[0].gain = Gain()  # inside a unit, so it keeps its class name
        self.seen["built_on"] = self.blocks[0].attn_q.weight.device
        self.seen["allocated"] = type(self.blocks[0].attn_q.weight).__name__ != "DeferredTensor"

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("meta_init", [False, True])
def test_layers_built_in_configure_model_end_up_sharded_with_their_values(trainer_env, tmp_path, meta_init):
    def sharded(model: L.LightningModule) -> None:
        assert all(isinstance(block, FSDPModule) for block in model.blocks)
        assert_sharded_and_finite(model)

    seen = SeenWhileTraining(sharded)
    fit_trainer = trainer(tmp_path, max_steps=2, strategy=FSDP2Strategy(meta_init=meta_init), callbacks=[seen])
    model = BuiltInConfigureModel()
    fit_trainer.fit(model, loader())

    # As Lightning's own strategies do, configure_model runs on the real device; meta_init defers the
    # parameters' memory (they still report the device they will be on).
    assert model.seen == {"mesh_dims": ("dp_shard",), "built_on": torch.device("cpu"), "allocated": not meta_init}
    assert seen.ran and fit_trainer.global_step == 2
    assert torch.equal(model.blocks[0].gain.weight, torch.full((2,), 3.0))  # lr 0: the values it was built with


class RecordStartState(L.Callback):
    """What the resumed run starts from: after the checkpoint is loaded, before any new step."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.global_step = trainer.global_step
        self.params = {name: full(p).detach().clone() for name, p in pl_module.named_parameters()}
        self.optimizer = optimizer_state_by_name(pl_module, trainer.optimizers[0])


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {key: full(value).clone() for key, value in optimizer.state[param].items()}
        for name, param in model.named_parameters()
    }


def test_sharded_checkpoint_save_then_resume_continues(trainer_env, tmp_path):
    torch.manual_seed(0)
    first = trainer(tmp_path, max_steps=2, strategy=FSDP2Strategy(state_dict_type="sharded"))
    model = TinyLM()
    first.fit(model, loader())
    path = tmp_path / "last"
    first.save_checkpoint(path)
    assert is_sharded_checkpoint(path)
    saved_params = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    saved_optimizer = optimizer_state_by_name(model, first.optimizers[0])
    assert saved_optimizer["blocks.0.attn_q.weight"]["step"].item() == 2

    trainer_env.fresh()
    torch.manual_seed(1)
    start = RecordStartState()
    second = trainer(tmp_path, max_steps=4, callbacks=[start])
    resumed = TinyLM()
    second.fit(resumed, loader(), ckpt_path=path)

    assert start.global_step == 2
    assert start.params.keys() == saved_params.keys()
    assert all(torch.equal(start.params[name], saved_params[name]) for name in saved_params)
    assert start.optimizer.keys() == saved_optimizer.keys()
    for name, state in saved_optimizer.items():
        assert state.keys() == start.optimizer[name].keys()
        assert all(torch.equal(start.optimizer[name][key], value) for key, value in state.items()), name
    assert second.global_step == 4
    assert not torch.equal(full(resumed.blocks[0].attn_q.weight), saved_params["blocks.0.attn_q.weight"])


class StaleOptimizer(TinyLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)


def test_optimizer_without_sharded_parameters_is_rejected(trainer_env, tmp_path):
    message = (
        "The optimizer does not reference any sharded parameter. HINT: create it in"
        " `configure_optimizers()` from `self.parameters()`, which the strategy calls after sharding."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer(tmp_path, strategy=FSDP2Strategy(meta_init=False), max_steps=1).fit(StaleOptimizer(), loader())


def test_full_state_dict_checkpoint_is_one_lightning_file_that_resumes(trainer_env, tmp_path):
    first = trainer(tmp_path, strategy=FSDP2Strategy(state_dict_type="full"), max_steps=2)
    model = TinyLM()
    first.fit(model, loader())
    path = tmp_path / "full.ckpt"
    first.save_checkpoint(path)
    saved_params = {name: full(p).detach().clone() for name, p in model.named_parameters()}

    assert path.is_file()
    checkpoint = torch.load(path, weights_only=False)
    assert not any(isinstance(t, DTensor) for t in checkpoint["state_dict"].values())
    assert torch.equal(checkpoint["state_dict"]["blocks.0.attn_q.weight"], saved_params["blocks.0.attn_q.weight"])
    state = checkpoint["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(saved_params)))  # keyed by index, as from DDP

    trainer_env.fresh()
    start = RecordStartState()
    second = trainer(tmp_path, max_steps=3, callbacks=[start], strategy=FSDP2Strategy(state_dict_type="sharded"))
    second.fit(TinyLM(), loader(), ckpt_path=path)
    assert start.global_step == 2
    assert all(torch.equal(start.params[name], saved_params[name]) for name in saved_params)
    assert second.global_step == 3


def test_resuming_from_a_damaged_or_foreign_checkpoint_names_the_problem(trainer_env, tmp_path):
    from fsdp_strategy import CheckpointError

    first = trainer(tmp_path, max_steps=1, strategy=FSDP2Strategy(state_dict_type="sharded"))
    first.fit(TinyLM(), loader())
    path = tmp_path / "saved.ckpt"
    first.save_checkpoint(path)

    trainer_env.fresh()
    foreign = trainer(tmp_path, max_steps=2)
    with pytest.raises(CheckpointError, match=re.escape(f"Checkpoint '{path}'")) as foreign_error:
        foreign.fit(TinyLM(n_layer=4), loader(), ckpt_path=path)
    assert "blocks.3" in str(foreign_error.value)

    trainer_env.fresh()
    (path / "__0_0.distcp").unlink()
    damaged = trainer(tmp_path, max_steps=2)
    with pytest.raises(CheckpointError, match=re.escape("shard file '__0_0.distcp' is missing")):
        damaged.fit(TinyLM(), loader(), ckpt_path=path)


def test_a_model_without_repeated_blocks_trains_with_everything_in_the_root(trainer_env, tmp_path):
    def root_only(model: L.LightningModule) -> None:
        assert isinstance(model, FSDPModule) and not isinstance(model.blocks[0], FSDPModule)
        assert all(isinstance(p, DTensor) for p in model.parameters())

    seen = SeenWhileTraining(root_only)
    trainer(tmp_path, max_steps=1, callbacks=[seen]).fit(TinyLM(n_layer=1), loader())
    assert seen.ran


def test_lightnings_own_consolidation_tool_reads_a_sharded_checkpoint(trainer_env, tmp_path):
    # What `python -m lightning.pytorch.utilities.consolidate_checkpoint` runs, in this process (the command itself,
    # in an interpreter of its own, is in integration_tests/test_consolidate_processes.py).
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    model = TinyLM()
    first = trainer(tmp_path, max_steps=1, strategy=FSDP2Strategy(state_dict_type="sharded"))
    first.fit(model, loader())
    path = tmp_path / "sharded.ckpt"
    first.save_checkpoint(path)
    state_dict = _format_checkpoint(_load_distributed_checkpoint(path))["state_dict"]
    for name, param in model.named_parameters():
        assert torch.equal(state_dict[name], full(param)), name


def test_model_checkpoint_top_k_and_last_manage_checkpoint_directories(trainer_env, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    directory = tmp_path / "checkpoints"
    checkpoints = ModelCheckpoint(
        dirpath=directory, monitor="train_loss", save_top_k=2, every_n_train_steps=1, save_last=True
    )
    run = trainer(
        tmp_path,
        max_steps=5,
        callbacks=[checkpoints],
        enable_checkpointing=True,
        strategy=FSDP2Strategy(state_dict_type="sharded"),
    )
    run.fit(TinyLM(), loader())
    kept = sorted(p.name for p in directory.iterdir())
    assert len(kept) == 3 and "last.ckpt" in kept, kept
    assert all(is_sharded_checkpoint(directory / name) for name in kept)
    assert {Path(p).name for p in checkpoints.best_k_models} == set(kept) - {"last.ckpt"}


class PlainSGD(TinyLM):
    """SGD without momentum keeps no per-parameter state."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_stateless_optimizer_resumes_from_a_full_file_and_the_trainer_pickles(trainer_env, tmp_path):
    import io

    first = trainer(tmp_path, max_steps=2)
    first.fit(PlainSGD(), loader())
    path = tmp_path / "plain.ckpt"
    first.save_checkpoint(path)
    assert path.is_file()  # "auto" on a small model: one file, as DDP writes
    torch.save(first, io.BytesIO())  # the Trainer, strategy included, pickles as under DDP

    trainer_env.fresh()
    second = trainer(tmp_path, max_steps=3)
    second.fit(PlainSGD(), loader(), ckpt_path=path)
    assert second.global_step == 3


def test_a_checkpoint_saved_before_any_stage_is_one_file(trainer_env, tmp_path):
    run = trainer(tmp_path)
    run.strategy.connect(TinyLM())
    run.save_checkpoint(tmp_path / "connected.ckpt")
    assert (tmp_path / "connected.ckpt").is_file()


class FailsInStep(TinyLM):
    def training_step(self, batch, batch_idx):
        self.loss(batch)  # the units are gathered when the error comes
        raise ValueError("the user's own error")


def test_an_error_inside_a_step_reaches_the_user_unchanged(trainer_env, tmp_path):
    with pytest.raises(ValueError, match="the user's own error"):
        trainer(tmp_path, max_steps=2).fit(FailsInStep(), loader())
