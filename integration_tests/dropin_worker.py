"""Modules that DDP handles with options or broadcasts: their runs under ``fsdp2`` and under DDP.

* ``moe``: a mixture of experts that skips idle experts. Tokens go to experts by hashing their id (a
  learned gate weighs each expert's output), so the data decide which experts work: on rank 0 expert 2
  never gets a token, on rank 1 it does; expert 3 gets tokens in the first two batches, then none on any
  rank. DDP needs ``ddp_find_unused_parameters_true`` for it.
* ``branch``: a second task whose head is used only for batches that contain a marker token: a
  data-dependent branch in the LightningModule itself (the FSDP root).
* ``experts_*``: experts that ``wrap_policy="auto"`` makes units of their own, as the repeated children of a
  plain ``nn.ModuleList`` on the LightningModule itself (``experts_root``) or in the one MoE layer
  (``experts_layer``). Every rank routes tokens to every expert in the first two batches; from the third on,
  expert 2 runs on even ranks only and expert 3 on odd ranks only: each rank runs three experts, their
  all-gathers pair up without a word, and the strategy must stop with ``UnitMismatchError`` before the
  third optimizer step (``*_manual``: manual optimization; ``*_validate``: ``trainer.validate``).
  ``experts_layer_fixed`` trains with the ``wrap_policy`` that error names; ``*_two_steps`` are the DDP
  references for the parameters at the error.
* ``gan``: manual optimization with two optimizers and two ``manual_backward`` calls per step, whose
  critic has a counting branch used for batches with the marker token only (``branch`` data).
* ``bn``: a CNN with BatchNorm and a running-scale normalizer that reads its buffer in the training
  forward, built with a different random init on each rank (no ``seed_everything``). DDP trains it from
  rank 0's init and broadcasts rank 0's buffers. ``bn_manual``: the same under manual optimization.
* ``syncbn``: the same CNN with ``Trainer(sync_batchnorm=True)``, which cannot run on the CPU: the
  error and whether the module was converted are recorded.

Each run is ``strategy/scenario`` (``--runs``); rank 0 writes a dict of results to ``--out``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning import LightningModule
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import fsdp_strategy  # noqa: F401  (registers the strategy names)

VOCAB, WIDTH, SEQ, EXPERTS = 32, 16, 6, 4
MARKER = VOCAB - 1  # the second task's marker token


# --- mixture of experts ---------------------------------------------------------------------------


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Top-1 routing by token id; an expert without tokens is skipped, as most MoE code does."""

    def __init__(self, width: int = WIDTH, experts: int = EXPERTS) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return mixture(x, tokens, self.norm, self.gate, self.experts)


def mixture(x: torch.Tensor, tokens: torch.Tensor, norm: nn.Module, gate: nn.Module, experts: nn.ModuleList) -> torch.Tensor:
    h = norm(x).flatten(0, 1)
    choice = tokens.flatten() % len(experts)
    weight = gate(h).softmax(-1).gather(1, choice[:, None])
    out = torch.zeros_like(h)
    for index, expert in enumerate(experts):
        rows = (choice == index).nonzero().flatten()
        if rows.numel() == 0:
            continue
        out = out.index_add(0, rows, (expert(h[rows]) * weight[rows]).to(out.dtype))
    return x + out.view_as(x)


class TinyMoE(LightningModule):
    def __init__(self, optimizer: str = "adamw", n_layer: int = 2) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(n_layer))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, tokens)
        return self.head(x)

    def loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


# --- a data-dependent branch in the root -----------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TwoTaskLM(LightningModule):
    """Next-token loss, plus a counting task for batches that hold the marker token."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)
        # Not an nn.Sequential of Linears: "auto" would make each Linear a unit, and a unit must run on
        # every rank at every step (README, "Modules that DDP needed find_unused_parameters for").
        self.count_hidden = nn.Linear(WIDTH, WIDTH)
        self.count_out = nn.Linear(WIDTH, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        loss = nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
        marked = (tokens == MARKER).any(dim=1)
        if marked.any():
            count = (tokens[marked] == MARKER).sum(dim=1, keepdim=True).float()
            predicted = self.count_out(torch.tanh(self.count_hidden(x[marked].mean(dim=1))))
            loss = loss + nn.functional.mse_loss(predicted, count)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def token_loader(scenario: str, *, rank: int, batch_size: int, batches: int) -> DataLoader:
    """This rank's token batches, in order (the runs pass ``use_distributed_sampler=False``).

    ``moe``: a token's id modulo 4 picks its expert. Odd ranks draw all four residues, even ranks never
    draw expert 2's; expert 3's ids appear only in the first two batches. ``experts``: every sample holds
    all four residues in the first two batches; after that 0, 1 and 2 on even ranks, 0, 1 and 3 on odd
    ones. ``branch``: the marker token appears on odd ranks in batch 0, on even ranks in batch 1, and
    nowhere after.
    """
    generator = torch.Generator().manual_seed(rank)
    samples = []
    for index in range(batch_size * batches):
        batch = index // batch_size
        if scenario == "moe":
            residues = [0, 1] + ([2] if rank % 2 == 1 else []) + ([3] if batch < 2 else [])
            ids = torch.tensor([t for t in range(VOCAB) if t % EXPERTS in residues])
            tokens = ids[torch.randint(0, len(ids), (SEQ + 1,), generator=generator)]
        elif scenario == "experts":
            residues = [0, 1, 2, 3] if batch < 2 else [0, 1, 2 + rank % 2]
            ids = torch.tensor([t for t in range(VOCAB) if t % EXPERTS in residues])
            tokens = ids[torch.randint(0, len(ids), (SEQ + 1,), generator=generator)]
            tokens[: len(residues)] = torch.tensor(residues) + EXPERTS  # each residue at least once
        else:
            tokens = torch.randint(0, MARKER, (SEQ + 1,), generator=generator)
            if (batch, rank % 2) in ((0, 1), (1, 0)):
                tokens[2] = MARKER
        samples.append(tokens)
    data = torch.stack(samples)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch_size, shuffle=False)


# --- experts as units of their own -----------------------------------------------------------------


class ExpertsLM(LightningModule):
    """Two blocks, then experts routed by token id: a plain ``nn.ModuleList`` on the LightningModule itself
    (``layer=False``), or inside one ``MoEBlock`` (``layer=True``); ``wrap_policy="auto"`` makes each expert
    a unit (the repeated children of a ModuleList), as it makes each block one."""

    def __init__(self, *, layer: bool, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        if layer:
            self.moe = MoEBlock()
        else:
            self.norm = nn.LayerNorm(WIDTH)
            self.gate = nn.Linear(WIDTH, EXPERTS, bias=False)
            self.experts = nn.ModuleList(Expert(WIDTH) for _ in range(EXPERTS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.moe(x, tokens) if hasattr(self, "moe") else mixture(x, tokens, self.norm, self.gate, self.experts)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


# --- two optimizers, two backward passes per step ---------------------------------------------------


class TwoOptimizerLM(LightningModule):
    """GAN-shaped manual optimization: the generator's loss goes through the critic (which so gets gradients
    its optimizer drops with ``zero_grad``); the critic then trains on detached features, with a counting
    branch for batches that hold the marker token. AdamW's weight decay would move a parameter whose
    gradient is zeros instead of ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.critic = nn.Linear(WIDTH, 1)
        self.count_hidden = nn.Linear(WIDTH, WIDTH)
        self.count_out = nn.Linear(WIDTH, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        tokens, targets = batch
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        g_loss = nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten()) - self.critic(x).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        features = x.detach()
        d_loss = self.critic(features).pow(2).mean()
        marked = (tokens == MARKER).any(dim=1)
        if marked.any():
            count = (tokens[marked] == MARKER).sum(dim=1, keepdim=True).float()
            predicted = self.count_out(torch.tanh(self.count_hidden(features[marked].mean(dim=1))))
            d_loss = d_loss + nn.functional.mse_loss(predicted, count)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, sync_dist=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        critic = [*self.critic.parameters(), *self.count_hidden.parameters(), *self.count_out.parameters()]
        generator = [*self.embed.parameters(), *self.blocks.parameters(), *self.head.parameters()]
        return [
            torch.optim.AdamW(generator, lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(critic, lr=1e-2, weight_decay=0.1),
        ]


# --- buffers ---------------------------------------------------------------------------------------


class RunningScale(nn.Module):
    """Divides by a running mean of |x| that it updates in the training forward (an EMA normalizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_abs", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.running_abs.mul_(0.9).add_(0.1 * x.detach().abs().mean())
        return x / self.running_abs


class TinyCNN(LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        )
        self.scale = RunningScale()
        self.classifier = nn.Linear(32, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.scale(self.features(images)))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_accuracy", (logits.argmax(-1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class ManualCNN(TinyCNN):
    """Manual optimization: DDP broadcasts buffers before the first forward only (README)."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def image_loader(*, rank: int, batch_size: int, batches: int, seed: int = 1) -> DataLoader:
    """This rank's images; each rank's come from a shifted distribution, so its batch statistics differ."""
    generator = torch.Generator().manual_seed(100 * seed + rank)
    count = batch_size * batches
    images = torch.randn(count, 1, 6, 6, generator=generator) + 0.5 * rank
    labels = torch.randint(0, 3, (count,), generator=generator)
    return DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=False)


# --- runs ------------------------------------------------------------------------------------------

SCENARIOS: dict[str, dict] = {
    "moe": {"model": "moe"},
    "moe_sgd": {"model": "moe", "optimizer": "sgd"},
    "moe_accumulate": {"model": "moe", "accumulate": 2},
    "moe_sgd_accumulate": {"model": "moe", "optimizer": "sgd", "accumulate": 2},
    "branch": {"model": "branch"},
    "gan": {"model": "gan"},
    "experts_root": {"model": "experts_root", "fails": True},
    "experts_root_manual": {"model": "experts_root", "manual": True, "fails": True},
    "experts_root_validate": {"model": "experts_root", "validate": True, "fails": True},
    "experts_layer": {"model": "experts_layer", "fails": True},
    "experts_layer_fixed": {"model": "experts_layer", "wrap_policy": ["Block", "MoEBlock"]},
    "experts_root_two_steps": {"model": "experts_root", "max_steps": 2},
    "experts_root_manual_two_steps": {"model": "experts_root", "manual": True, "max_steps": 2},
    "experts_layer_two_steps": {"model": "experts_layer", "max_steps": 2},
    "branch_sgd_accumulate": {"model": "branch", "optimizer": "sgd", "accumulate": 2},
    "bn": {"model": "bn"},
    "bn_adamw_accumulate": {"model": "bn", "optimizer": "adamw", "accumulate": 2},
    "bn_manual": {"model": "bn", "manual": True},
    "syncbn": {"model": "bn", "sync_batchnorm": True},
}


class BatchNormClasses(L.Callback):
    """The BatchNorm classes of the module when ``fit`` fails (in setup), before the strategy's teardown."""

    def __init__(self) -> None:
        self.at_failure: list[str] = []

    def on_exception(self, trainer, pl_module, exception) -> None:  # type: ignore[no-untyped-def]
        self.at_failure = _batchnorm_classes(pl_module)


def _batchnorm_classes(module: nn.Module) -> list[str]:
    return [type(m).__name__ for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class BufferRecorder(L.Callback):
    """Each rank's buffers after the last training batch (before validation broadcasts them)."""

    def __init__(self) -> None:
        self.after_last_batch: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.after_last_batch = {k: v.detach().clone() for k, v in pl_module.named_buffers()}


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if any(isinstance(p, DTensor) for p in model.parameters()):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        buffers = dict(model.named_buffers())
        return {k: v.float() for k, v in state.items() if k not in buffers}
    return {k: v.detach().float().clone() for k, v in model.named_parameters()}


def train(strategy: str, scenario: dict, *, devices: int, rank: int, max_steps: int) -> dict:
    accumulate = scenario.get("accumulate", 1)
    max_steps = scenario.get("max_steps", max_steps)
    batches = max_steps * accumulate
    if "wrap_policy" in scenario:
        strategy = fsdp_strategy.FSDP2Strategy(wrap_policy=scenario["wrap_policy"], state_dict_type="full")
    if scenario["model"].startswith("experts"):
        L.seed_everything(42)
        model = ExpertsLM(layer=scenario["model"] == "experts_layer", manual=scenario.get("manual", False))
        loader = token_loader("experts", rank=rank, batch_size=2, batches=batches)
        val_loader = loader if scenario.get("validate") else None
    elif scenario["model"] == "gan":
        L.seed_everything(42)
        model = TwoOptimizerLM()
        loader = token_loader("branch", rank=rank, batch_size=2, batches=batches)
        val_loader = None
    elif scenario["model"] == "bn":
        torch.manual_seed(1000 + rank)  # no seed_everything: every rank builds its own random init
        model: LightningModule = (ManualCNN if scenario.get("manual") else TinyCNN)(scenario.get("optimizer", "sgd"))
        loader = image_loader(rank=rank, batch_size=4, batches=batches)
        val_loader = image_loader(rank=rank, batch_size=4, batches=2, seed=2)
    else:
        L.seed_everything(42)
        model_class = TinyMoE if scenario["model"] == "moe" else TwoTaskLM
        model = model_class(scenario.get("optimizer", "adamw"))
        loader = token_loader(scenario["model"], rank=rank, batch_size=2, batches=batches)
        val_loader = loader if scenario["model"] == "moe" else None
    recorder, batchnorms = BufferRecorder(), BatchNormClasses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        sync_batchnorm=scenario.get("sync_batchnorm", False),
        use_distributed_sampler=False,  # each rank's batches are laid out above
        limit_val_batches=(batches if scenario.get("validate") else 2) if val_loader is not None else 0,
        val_check_interval=batches,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, batchnorms],
    )
    if scenario.get("fails"):
        try:
            if scenario.get("validate"):
                trainer.validate(model, loader, verbose=False)
            else:
                trainer.fit(model, loader)
            error = None
        except fsdp_strategy.UnitMismatchError as exc:
            error = f"{type(exc).__name__}: {exc}"
        errors: list = [None] * trainer.world_size
        dist.all_gather_object(errors, error)
        return {"errors": errors, "params": _full_params(model), "global_step": trainer.global_step}
    if scenario.get("sync_batchnorm"):
        try:
            trainer.fit(model, loader, val_loader)
            error = None
        except Exception as exc:  # noqa: BLE001  (the error is the result)
            error = f"{type(exc).__name__}: {exc}"
        return {"error": error, "at_failure": batchnorms.at_failure, "after_fit": _batchnorm_classes(model)}
    trainer.fit(model, loader, val_loader)
    per_rank: list = [None] * trainer.world_size
    dist.all_gather_object(
        per_rank,
        {
            "buffers_after_last_batch": recorder.after_last_batch,
            "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        },
    )
    return {
        "params": _full_params(model),
        "per_rank": per_rank,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help=f"comma-separated strategy/scenario ({', '.join(SCENARIOS)})")
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    results = {}
    for run in args.runs.split(","):
        strategy, scenario = run.split("/")
        results[run] = train(strategy, SCENARIOS[scenario], devices=devices, rank=rank, max_steps=args.max_steps)
    if rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
