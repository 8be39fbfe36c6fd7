"""A LightningModule with a frozen base, written to run with that base in any dtype (``frozen_dtype``)."""

from __future__ import annotations

import torch
from lightning import LightningModule
from torch import nn

__all__ = ["FrozenBaseRegressor"]


class FrozenBaseRegressor(LightningModule):
    """A frozen base feeding a trainable head; the base's input is cast to its weight's dtype, as peft's LoRA layers
    cast theirs. Batches are ``(x, y)`` of widths ``8`` and ``3``."""

    def __init__(self, hidden: int = 24) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 8)).requires_grad_(False)
        self.head = nn.Linear(8, 3)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = self.base(x.to(self.base[0].weight.dtype)).float()
        return nn.functional.mse_loss(self.head(features), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)
