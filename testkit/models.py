"""Tiny deterministic LightningModules shared by the unit tests, the integration runs and the examples of this project."""

from __future__ import annotations

import torch
from lightning import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

VOCAB, WIDTH, SEQ = 32, 16, 8


class Block(nn.Module):
    def __init__(self, width: int = WIDTH, hidden: int | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn_q = nn.Linear(width, width)
        # No key bias: its gradient is exactly zero (softmax ignores a per-query constant), and AdamW
        # turns the summation-order noise of such a gradient into visible updates, hiding real parity.
        self.attn_k = nn.Linear(width, width, bias=False)
        hidden = 2 * width if hidden is None else hidden
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = self.attn_q(h) @ self.attn_k(h).transpose(-1, -2) / h.shape[-1] ** 0.5
        x = x + torch.softmax(scores, dim=-1) @ h
        return x + self.mlp(x)


class TinyLM(LightningModule):
    """Embedding tied to the output head, a ModuleList of blocks, and a parameter owned by the module itself.

    ``vocab``, ``width`` and ``hidden`` (each block's MLP width, one per layer) change the shapes: the defaults divide
    evenly over 1, 2 and 4 ranks; :func:`uneven_lm` gives dimensions that do not (FSDP2's padded shards).
    """

    def __init__(
        self,
        optimizer: str = "adamw",
        n_layer: int = 3,
        lr: float = 1e-2,
        scheduler: bool = False,
        *,
        vocab: int = VOCAB,
        width: int = WIDTH,
        hidden: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.optimizer_name, self.lr, self.scheduler = optimizer, lr, scheduler
        hidden = hidden or (2 * width,) * n_layer
        if len(hidden) != n_layer:
            raise ValueError(f"`hidden` needs one width per layer ({n_layer}); got {hidden}")
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, h) for h in hidden)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(width))
        self.val_accuracy = MulticlassAccuracy(num_classes=vocab, average="micro")

    def reset_parameters(self) -> None:
        # Called for the module's own parameters when it is materialized from the meta device.
        nn.init.ones_(self.scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        logits = self(tokens)
        self.log(
            "val_loss", nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()), sync_dist=True
        )
        # torchmetrics syncs its own state across ranks when computed at epoch end.
        self.val_accuracy(logits.flatten(0, 1), targets.flatten())
        self.log("val_accuracy", self.val_accuracy)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)}


# Row counts that 2 and 4 ranks do not divide: a vocabulary of 37 (shards of 19/18 rows, 10/10/10/7), a width of
# 13 (every LayerNorm weight and bias, the scale, the attention projections and their biases: 4/4/4/1 rows at 4 ranks),
# MLP widths of 5 (2/2/1/0: the last of 4 ranks holds no row), 7 and 26 (13/13 at 2 ranks, 7/7/7/5 at 4).
UNEVEN = {"vocab": 37, "width": 13, "hidden": (5, 7, 26)}


def uneven_lm(optimizer: str = "adamw") -> TinyLM:
    """A :class:`TinyLM` whose parameters' first dimensions divide by neither 2 nor 4 (data: tokens below ``VOCAB``)."""
    return TinyLM(optimizer=optimizer, n_layer=len(UNEVEN["hidden"]), **UNEVEN)


def token_dataset(samples: int = 64, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def token_loader(batch_size: int = 4, samples: int = 64) -> DataLoader:
    return DataLoader(token_dataset(samples), batch_size=batch_size, shuffle=False)


class TinyGAN(LightningModule):
    """Manual optimization with two optimizers: the generator's loss goes through the discriminator
    that was updated earlier in the same step, so stale discriminator weights would change the result.
    ``temperature`` is owned by the LightningModule itself (the FSDP root) and is used on both sides
    of that update."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
        self.discriminator = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, 1))
        self.temperature = nn.Parameter(torch.ones(1))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.temperature)

    def judge(self, samples: torch.Tensor) -> torch.Tensor:
        return self.discriminator(samples) * self.temperature

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real = self.embed_batch(batch)
        noise = torch.randn(real.shape, generator=torch.Generator().manual_seed(batch_idx))
        fake = self.generator(noise)
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        d_loss = bce(self.judge(real), ones) + bce(self.judge(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = bce(self.judge(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, sync_dist=True)

    @staticmethod
    def embed_batch(batch: list[torch.Tensor]) -> torch.Tensor:
        tokens, _ = batch
        return torch.nn.functional.one_hot(tokens[:, 0] % WIDTH, WIDTH).float()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-2),
            torch.optim.Adam([*self.discriminator.parameters(), self.temperature], lr=1e-2),
        ]


class PoisonedLM(TinyLM):
    """``TinyLM`` whose loss holds inf on ``poison_rank`` at ``poison_step`` (every rank when ``None``).

    The inf enters through one element of the module's own ``scale`` parameter, so only that
    element's gradient is infinite; sharded over 2 ranks it lies in rank 1's shard alone.
    """

    def __init__(self, poison_step: int | None, poison_rank: int | None = None, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.poison_step, self.poison_rank = poison_step, poison_rank

    def poisoned(self, loss: torch.Tensor) -> torch.Tensor:
        if self.global_step == self.poison_step and self.poison_rank in (None, self.global_rank):
            return loss + self.scale[-4] * float("inf")
        return loss

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.poisoned(super().training_step(batch, batch_idx))
