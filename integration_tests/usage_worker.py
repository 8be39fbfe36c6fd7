"""Ordinary training scripts, run under "ddp" and under "fsdp2" with Lightning's own launcher (``--devices N``).

Each scenario is written the way users write it: a Hugging Face model loaded in ``configure_model``, a
model built under ``trainer.init_module(empty_init=True)``, a regression with float targets under
``bf16-mixed``, the module used after ``fit``, and the usual end of a script (``trainer.test(ckpt_path="best")``,
``load_from_checkpoint``). Rank 0 writes what each scenario saw to ``--out``; the test compares the
strategies with each other (DDP is the reference) and with an eager build.
"""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import fsdp_strategy
from testkit.models import TinyLM, token_loader

STEPS = 4


def make_trainer(strategy: str, devices: int, **kwargs) -> L.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=fsdp_strategy.FSDP2Strategy(state_dict_type="sharded") if strategy == "fsdp2_sharded" else strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor, sharded or not (collective when sharded)."""
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    }


# --- a Hugging Face model loaded in configure_model ------------------------------------------------------


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=3,
    )  # fmt: skip


def llama_batches(samples: int = 32) -> DataLoader:
    tokens = torch.randint(0, 64, (samples, 12), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens), batch_size=4)


class FineTune(L.LightningModule):
    """Loads pretrained weights in configure_model, as in Hugging Face fine-tuning recipes."""

    def __init__(self, pretrained: str, how: str) -> None:
        super().__init__()
        self.pretrained, self.how = pretrained, how
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import LlamaForCausalLM

        if self.how == "from_pretrained":
            self.model = LlamaForCausalLM.from_pretrained(self.pretrained)
        else:
            self.model = LlamaForCausalLM(llama_config())
            self.model.load_state_dict(torch.load(Path(self.pretrained) / "weights.pt"))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StartState(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.state = full_state(pl_module)


def fine_tune(strategy: str, devices: int, pretrained: str) -> dict:
    results = {}
    for how in ("from_pretrained", "load_state_dict"):
        L.seed_everything(7)
        start = StartState()
        trainer = make_trainer(strategy, devices, max_steps=STEPS, callbacks=[start])
        module = FineTune(pretrained, how)
        trainer.fit(module, llama_batches())
        results[how] = {"start": start.state, "final": full_state(module)}
    return results


# --- init_module(empty_init=True) --------------------------------------------------------------------------


class Probe(nn.Module):
    """Parameters written by rows, as padding rows and position tables are."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.empty(10, 3))
        with torch.no_grad():
            self.positions.copy_(torch.arange(30.0).reshape(10, 3))
            self.positions[4].fill_(-1.0)


class BuiltDeferred(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(llama_config())
        self.probe = Probe()

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss + 0 * self.probe.positions.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class ShardsSeen(L.Callback):
    """Each rank's own shard of the embedding, and the full state, before any step."""

    def on_train_start(self, trainer, pl_module) -> None:
        weight = pl_module.model.model.embed_tokens.weight
        local = weight.to_local().clone() if isinstance(weight, DTensor) else weight.detach().clone()
        shards = [None] * trainer.world_size
        dist.all_gather_object(shards, local)
        self.shards = shards
        self.state = full_state(pl_module)


def deferred(strategy: str, devices: int) -> dict:
    L.seed_everything(7)
    seen = ShardsSeen()
    trainer = make_trainer(strategy, devices, max_steps=1, callbacks=[seen])
    with trainer.init_module(empty_init=True):
        module = BuiltDeferred()
    trainer.fit(module, llama_batches())
    torch.manual_seed(0)
    eager = BuiltDeferred()  # the reference for buffers and for the init scheme
    return {"shards": seen.shards, "state": seen.state, "eager": full_state(eager)}


# --- a regression with float targets under bf16-mixed -----------------------------------------------------


class Regression(L.LightningModule):
    """Float inputs, targets and per-sample weights; records the dtypes each step method receives."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.dtypes: dict[str, list[str]] = {}

    def _loss(self, batch, stage: str) -> torch.Tensor:
        x, y, w = batch
        self.dtypes[stage] = [str(t.dtype) for t in batch]
        return (w * (self.net(x).squeeze(-1) - y) ** 2).mean()

    def training_step(self, batch, batch_idx):
        return self._loss(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._loss(batch, "validate")

    def test_step(self, batch, batch_idx):
        self._loss(batch, "test")

    def predict_step(self, batch, batch_idx):
        self._loss(batch, "predict")
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def regression_data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    y = 1000.0 + x.sum(-1) + 0.01 * torch.randn(64, generator=generator)  # large, finely resolved targets
    w = torch.rand(64, generator=generator) + 0.5
    return DataLoader(TensorDataset(x, y, w), batch_size=8)


def regression(strategy: str, devices: int) -> dict:
    results = {}
    for precision in ("32-true", "bf16-mixed"):
        L.seed_everything(3)
        trainer = make_trainer(strategy, devices, max_steps=8, precision=precision, limit_val_batches=1)
        module = Regression()
        trainer.fit(module, regression_data(), regression_data())
        trainer.test(module, regression_data(), verbose=False)
        trainer.predict(module, regression_data())
        results[precision] = {"dtypes": dict(module.dtypes), "final": full_state(module)}
    return results


# --- the module after fit, and the usual end of a script ---------------------------------------------------


class ScriptLM(TinyLM):
    def test_step(self, batch, batch_idx) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)


def after_fit(strategy: str, devices: int, directory: Path) -> dict:
    L.seed_everything(11)
    checkpoints = ModelCheckpoint(dirpath=directory / strategy, monitor="val_loss", save_top_k=1, every_n_train_steps=2)
    trainer = make_trainer(
        strategy, devices, max_steps=STEPS, callbacks=[checkpoints], enable_checkpointing=True,
        limit_val_batches=2, val_check_interval=2, check_val_every_n_epoch=None,
    )  # fmt: skip
    model = ScriptLM()
    trainer.fit(model, token_loader(), token_loader())
    (tested,) = trainer.test(ckpt_path="best", dataloaders=token_loader(), verbose=False)
    result: dict = {"test_metrics": tested, "best_is_file": Path(checkpoints.best_model_path).is_file()}

    state = model.state_dict()
    result["state_dict_types"] = sorted({type(t).__name__ for t in state.values()})
    result["state_dict"] = {k: v.detach().clone() for k, v in state.items()}
    model.load_state_dict(state)  # a plain, full state dict loads back
    buffer = io.BytesIO()
    torch.save(trainer.model, buffer)  # the whole module pickles
    result["pickled_bytes"] = len(buffer.getvalue())
    try:
        loaded = ScriptLM.load_from_checkpoint(checkpoints.best_model_path)
        result["loaded_from_best"] = full_state(loaded)
    except IsADirectoryError as error:
        result["loaded_from_best"] = f"IsADirectoryError: {error}"
        consolidated = directory / f"{strategy}-best-consolidated.ckpt"
        if trainer.is_global_zero:
            fsdp_strategy.consolidate_checkpoint(checkpoints.best_model_path, consolidated)
        trainer.strategy.barrier()
        result["loaded_from_consolidated"] = full_state(ScriptLM.load_from_checkpoint(consolidated))
    if trainer.is_global_zero:  # inference on rank 0 alone, while the other ranks go on
        model.eval()
        with torch.no_grad():
            result["rank0_logits"] = model(next(iter(token_loader()))[0])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="ddp,fsdp2")
    parser.add_argument("--scenarios", default="fine_tune,deferred,regression,after_fit")
    parser.add_argument("--pretrained", default="")
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    results: dict = {}
    for strategy in args.strategies.split(","):
        for scenario in args.scenarios.split(","):
            if scenario == "fine_tune":
                outcome = fine_tune(strategy, args.devices, args.pretrained)
            elif scenario == "deferred":
                if strategy == "ddp":  # DDP leaves empty_init's parameters uninitialized: nothing to compare
                    continue
                outcome = deferred(strategy, args.devices)
            elif scenario == "regression":
                outcome = regression(strategy, args.devices)
            else:
                outcome = after_fit(strategy, args.devices, args.directory)
            results[f"{strategy}/{scenario}"] = outcome
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
