"""Modules that ranks use differently, as DDP handles with options or broadcasts: a mixture of experts that
skips idle experts, data-dependent branches, experts that the "auto" policy makes units of their own, a GAN
critic with a branch, a CNN with BatchNorm and a buffer read in its training forward; and their loaders,
which give each rank its own batches. ``integration_tests/dropin_worker.py`` trains them under ``fsdp2`` and DDP.
"""

from __future__ import annotations

import torch
from lightning import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

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


def mixture(
    x: torch.Tensor, tokens: torch.Tensor, norm: nn.Module, gate: nn.Module, experts: nn.ModuleList
) -> torch.Tensor:
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
            nn.Conv2d(1, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
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
