"""Fine-tuning and copying patterns under ``fsdp2`` and their references: frozen weights, unfreezing, copies of
modules, gradients read in ``on_before_optimizer_step``, checkpoints that must not touch the optimizer, hook order.

Each run is ``strategy/scenario`` (``--runs``); rank 0 writes a dict of results to ``--out``. Rank ``r`` trains on
its own slice of every global batch (no sampler), so a run of ``single`` (one process, ``strategy="auto"``, the
whole global batch) sees what the ranks see together: it is the reference where DDP itself is wrong (DDP builds
its gradient reduction once, from the parameters that require grad at that moment, so parameters unfrozen later
are never averaged and the ranks drift apart).

Scenarios:

* ``frozen``: a frozen backbone, a trainable head, AdamW (only trainable parameters get optimizer state).
* ``tied_frozen``: an embedding tied to the output head and frozen, the rest trainable.
* ``lora``: a tiny Hugging Face Llama with ``peft`` LoRA adapters (base weights frozen).
* ``unfreeze``: Lightning's ``BackboneFinetuning``, the backbone frozen in epoch 0 and unfrozen from epoch 1.
* ``unfreeze_resume``: the same, saved at the end of epoch 0 (frozen) and resumed into the unfrozen epochs.
* ``toggled``: the user freezes and unfreezes layers with ``requires_grad_`` between steps.
* ``toggle_optimizer``: manual optimization with two optimizers and ``toggle_optimizer``.
* ``copies``: ``copy.deepcopy`` of submodules and of the LightningModule during ``fit`` (a teacher used in every
  step, a snapshot in ``training_step``), ``torch.save`` and ``pickle`` of submodules in a callback.
* ``grad_norm``: Lightning's ``grad_norm`` logged in ``on_before_optimizer_step``, plus clipping written by hand.
* ``save_every_step``: plain SGD that counts its steps; a checkpoint after every step (automatic optimization),
  and one between ``manual_backward`` and ``opt.step()`` (manual).
* ``hooks`` / ``hooks_sharded``: every hook's call, in order, through fit, resume, validate, test and predict.
* ``pruning``: Lightning's ``ModelPruning``, refused before training.
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import pickle
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, ModelPruning
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import fsdp_strategy

WIDTH, OUT, VOCAB, LOCAL_BATCH = 6, 5, 16, 2  # 6 rows over 4 ranks: uneven, padded shards


# --- models -------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Regressor(L.LightningModule):
    def __init__(self, optimizer: str = "adamw", freeze_backbone: bool = False) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.backbone = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, OUT)
        if freeze_backbone:
            self.stem.requires_grad_(False)
            self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(self.stem(x)))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]  # as fine-tuning recipes write it
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(trainable, lr=0.1)
        if self.optimizer_name == "counting_sgd":
            return CountingSGD(trainable)
        return torch.optim.AdamW(trainable, lr=0.05, weight_decay=0.1)


class CountingSGD(torch.optim.SGD):
    """Plain SGD (it never has state) that counts its steps."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.steps = 0

    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        return super().step(closure)


class TiedLM(L.LightningModule):
    """Token model whose output head shares the embedding's weight; the embedding is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.embed.weight
        self.embed.requires_grad_(False)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, _ = batch
        logits = self.head(self.blocks(self.embed(tokens[:, :-1])))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05)


class LoraLM(L.LightningModule):
    """A tiny Hugging Face Llama (built from a config) with peft's LoRA adapters on the attention projections."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=8,
            intermediate_size=12,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
        lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(LlamaForCausalLM(config), lora)
        for name, param in self.model.named_parameters():  # LoRA's B starts at zero: give the test something to train
            if "lora_B" in name:
                nn.init.normal_(param, std=0.1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, _ = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05)


class ToggledRegressor(Regressor):
    """Freezes the head on odd steps and the first block from step 2 on, with ``requires_grad_``."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.head.requires_grad_(batch_idx % 2 == 0)
        self.backbone[0].requires_grad_(batch_idx < 2)


class TwoOptimizerRegressor(Regressor):
    """Manual optimization: one optimizer for the stem and backbone, one for the head, each stepped in turn
    with ``toggle_optimizer`` (the other's parameters frozen meanwhile), the GAN pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        for opt in self.optimizers():
            self.toggle_optimizer(opt)
            loss = nn.functional.mse_loss(self(x), y)
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        body = [*self.stem.parameters(), *self.backbone.parameters()]
        return [torch.optim.SGD(body, lr=0.1, momentum=0.9), torch.optim.AdamW(self.head.parameters(), lr=0.05)]


class CopyingRegressor(Regressor):
    """Deep-copies submodules during fit: a frozen teacher (made in ``on_train_start``, used in every step) and
    a snapshot of the head in ``training_step`` before the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def on_train_start(self) -> None:
        self.teacher = copy.deepcopy(self.backbone)  # a submodule now, as a user's assignment makes it
        self.teacher.requires_grad_(False)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        snapshot = copy.deepcopy(self.head)
        self.snapshots.append({k: v.detach().clone() for k, v in snapshot.state_dict().items()})
        features = self.backbone(self.stem(x))
        with torch.no_grad():
            target = self.teacher(self.stem(x))
        return nn.functional.mse_loss(self.head(features), y) + 0.1 * nn.functional.mse_loss(features, target)


class GradNormRegressor(Regressor):
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.05)  # clipping written in the hook


class SaveBeforeStep(Regressor):
    """Manual optimization that saves a checkpoint between backward and ``opt.step()``."""

    def __init__(self) -> None:
        super().__init__(optimizer="counting_sgd")
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        self.trainer.save_checkpoint(os.path.join(self.trainer.default_root_dir, f"mid-{batch_idx}.ckpt"))
        opt.step()
        opt.zero_grad()


# --- data ---------------------------------------------------------------------------------------------------------


def global_batches(kind: str, steps: int, world: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        size = world * LOCAL_BATCH
        if kind == "tokens":
            tokens = torch.randint(0, VOCAB, (size, 8), generator=generator)
            batches.append((tokens, tokens))
        else:
            batches.append((torch.randn(size, WIDTH, generator=generator), torch.randn(size, OUT, generator=generator)))
    return batches


def loader(kind: str, steps: int, world: int, rank: int | None) -> DataLoader:
    """Rank ``rank``'s slice of each global batch (``None``: the whole batch, for the single-process reference)."""
    xs, ys = zip(*global_batches(kind, steps, world))
    if rank is not None:
        xs = tuple(x[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for x in xs)
        ys = tuple(y[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for y in ys)
    batch = LOCAL_BATCH if rank is not None else world * LOCAL_BATCH
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=batch)


# --- hook recording -----------------------------------------------------------------------------------------------

MODULE_HOOKS = [
    name
    for name in dir(L.LightningModule)
    if name.startswith("on_")
    or name
    in (
        "setup",
        "teardown",
        "configure_model",
        "configure_optimizers",
        "load_state_dict",
        "state_dict",
        "configure_gradient_clipping",
        "optimizer_step",
        "backward",
    )
]
CALLBACK_HOOKS = [
    name
    for name in dir(Callback)
    if name.startswith("on_") or name in ("setup", "teardown", "load_state_dict", "state_dict")
]


def recording(cls: type, calls: list[str], prefix: str, hooks: list[str]) -> type:
    """A subclass of ``cls`` that appends ``prefix + hook`` to ``calls`` whenever one of ``hooks`` runs."""

    def wrap(name: str) -> Any:
        original = getattr(cls, name)

        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(prefix + name + (f"({','.join(sorted(kwargs))})" if name == "load_state_dict" else ""))
            return original(self, *args, **kwargs)

        return hook

    return type(f"Recording{cls.__name__}", (cls,), {name: wrap(name) for name in hooks})


# --- runs ---------------------------------------------------------------------------------------------------------


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone()
        for k, v in model.named_parameters()
    }


def make_trainer(strategy: str, devices: int, **kwargs: Any) -> L.Trainer:
    if strategy == "single":
        strategy = "auto"
    # CountingSGD overrides `step` (to count its calls): declared elementwise, as a user declares such a subclass.
    declared = ["CountingSGD"]
    if strategy == "fsdp2_sharded":
        strategy = fsdp_strategy.FSDP2Strategy(state_dict_type="sharded", elementwise_optimizers=declared)  # type: ignore[assignment]
    elif strategy == "fsdp2":
        strategy = fsdp_strategy.FSDP2Strategy(elementwise_optimizers=declared)  # type: ignore[assignment]
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def run(strategy: str, scenario: str, *, devices: int, world: int, rank: int | None, root: str) -> dict[str, Any]:
    L.seed_everything(0)
    steps = 4
    if scenario == "hooks" or scenario == "hooks_sharded":
        return hook_order(strategy, devices=devices, world=world, rank=rank, root=root)
    if scenario == "pruning":
        trainer = make_trainer(strategy, devices, max_steps=1, callbacks=[ModelPruning("l1_unstructured", amount=0.5)])
        try:
            trainer.fit(Regressor(), loader("regression", 1, world, rank))
        except Exception as error:  # noqa: BLE001  (the refusal is the result)
            return {"error": f"{type(error).__name__}: {error}"}
        return {"error": None}
    if scenario in ("unfreeze", "unfreeze_resume"):
        return unfreeze(
            strategy, resume=scenario == "unfreeze_resume", devices=devices, world=world, rank=rank, root=root
        )
    kind = "tokens" if scenario in ("tied_frozen", "lora") else "regression"
    model: L.LightningModule = {
        "frozen": lambda: Regressor(freeze_backbone=True),
        "tied_frozen": TiedLM,
        "lora": LoraLM,
        "toggled": ToggledRegressor,
        "toggle_optimizer": TwoOptimizerRegressor,
        "copies": CopyingRegressor,
        "grad_norm": GradNormRegressor,
        "save_every_step": lambda: Regressor(optimizer="counting_sgd"),
        "save_before_step": SaveBeforeStep,
    }[scenario]()
    extra: dict[str, Any] = {}
    if scenario == "save_every_step":
        from lightning.pytorch.callbacks import ModelCheckpoint

        extra = {
            "enable_checkpointing": True,
            "callbacks": [ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)],
        }
    copier = CopyInCallback()
    if scenario == "copies":
        extra = {"callbacks": [copier]}
    trainer = make_trainer(strategy, devices, max_steps=steps, default_root_dir=root, **extra)
    trainer.fit(model, loader(kind, steps, world, rank))
    result: dict[str, Any] = {
        "params": full_params(model),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "optimizer_state_entries": [len(o.state) for o in trainer.optimizers],
    }
    if scenario in ("save_every_step", "save_before_step"):
        result["optimizer_steps"] = trainer.optimizers[0].steps
    if scenario == "copies":
        after = copy.deepcopy(model)  # after fit: the user's plain module
        result.update(
            snapshots=model.snapshots,
            teacher=full_params(model.teacher),
            copies=copier.copies,
            copy_after_fit=full_params(after),
        )
    return result


class CopyInCallback(Callback):
    """At the second batch: ``torch.save`` of the backbone, ``pickle`` of the head and a deep copy of the whole
    LightningModule (its output on a fixed input), each read back as a plain module."""

    def __init__(self) -> None:
        self.copies: dict[str, Any] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != 1:
            return
        buffer = io.BytesIO()
        torch.save(pl_module.backbone, buffer)
        buffer.seek(0)
        backbone = torch.load(buffer, weights_only=False)
        head = pickle.loads(pickle.dumps(pl_module.head))
        whole = copy.deepcopy(pl_module)
        probe = torch.linspace(-1, 1, 2 * WIDTH).view(2, WIDTH)
        self.copies = {
            "classes": [type(backbone).__name__, type(head).__name__, type(whole).__name__],
            "backbone": full_params(backbone),
            "head": full_params(head),
            "whole_output": whole(probe).detach(),
        }


class UnfreezeOnce(BackboneFinetuning):
    def __init__(self) -> None:
        super().__init__(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5, should_align=False)

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze([pl_module.stem, pl_module.backbone])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.unfreeze_backbone_at_epoch:
            self.unfreeze_and_add_param_group([pl_module.stem, pl_module.backbone], optimizer, lr=0.05)


def unfreeze(strategy: str, *, resume: bool, devices: int, world: int, rank: int | None, root: str) -> dict[str, Any]:
    steps_per_epoch = 2
    data = loader("regression", steps_per_epoch, world, rank)
    model = Regressor(optimizer="sgd")
    trainer = make_trainer(
        strategy, devices, max_epochs=1 if resume else 3, callbacks=[UnfreezeOnce()], default_root_dir=root
    )
    trainer.fit(model, data)
    if resume:
        path = os.path.join(root, "frozen.ckpt")
        trainer.save_checkpoint(path)
        model = Regressor(optimizer="sgd")
        trainer = make_trainer(strategy, devices, max_epochs=3, callbacks=[UnfreezeOnce()], default_root_dir=root)
        trainer.fit(model, data, ckpt_path=path)
    return {"params": full_params(model), "param_groups": [len(o.param_groups) for o in trainer.optimizers]}


def hook_order(strategy: str, *, devices: int, world: int, rank: int | None, root: str) -> dict[str, list[str]]:
    calls: list[str] = []
    module_class = recording(Regressor, calls, "M.", MODULE_HOOKS)
    callback_class = recording(Callback, calls, "C.", CALLBACK_HOOKS)
    data = loader("regression", 2, world, rank)

    def trainer(**kwargs: Any) -> L.Trainer:
        return make_trainer(strategy, devices, callbacks=[callback_class()], **kwargs)

    seen: dict[str, list[str]] = {}
    first = trainer(max_steps=2, limit_val_batches=1, default_root_dir=root)
    calls.clear()
    first.fit(module_class(), data, data)
    seen["fit"] = list(calls)
    path = os.path.join(root, "hooks.ckpt")
    first.save_checkpoint(path)
    for stage, call in (
        ("resume", lambda t, m: t.fit(m, data, data, ckpt_path=path)),
        ("validate", lambda t, m: t.validate(m, data, ckpt_path=path, verbose=False)),
        ("test", lambda t, m: t.test(m, data, verbose=False)),
        ("predict", lambda t, m: t.predict(m, data)),
    ):
        calls.clear()
        call(
            trainer(
                max_steps=4, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1, default_root_dir=root
            ),
            module_class(),
        )
        seen[stage] = list(calls)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True)
    parser.add_argument("--world", type=int, help="ranks of the job whose batches a single process takes whole")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distributed = "LOCAL_WORLD_SIZE" in os.environ
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    world = devices if distributed else args.world
    results = {}
    for entry in args.runs.split(","):
        strategy, scenario = entry.split("/")
        root = os.path.join(os.getcwd(), entry.replace("/", "-"))
        results[entry] = run(
            strategy, scenario, devices=devices, world=world, rank=rank if distributed else None, root=root
        )
        if distributed:
            dist.barrier()
    if rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
