"""LightningModules as users write them around optimizers that read whole tensors, and user code that reads whole
parameters in ``training_step``: the scenarios of ``integration_tests/optimizers_worker.py``.

Row counts (30, 18, 5) do not divide by 4, so 4 ranks hold uneven shards, one of them an empty one.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["OPTIMIZERS", "PENALTIES", "TORCH_OPTIMIZERS", "Regression", "regression_loader"]


def regression_loader(samples: int = 96, batch_size: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(samples, 12, generator=generator)
    targets = torch.randn(samples, 5, generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=batch_size)


def _muon(module: Regression) -> Any:
    muon = torch.optim.Muon(module.parameters(), lr=0.02, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    return {"optimizer": muon, "lr_scheduler": torch.optim.lr_scheduler.StepLR(muon, step_size=2, gamma=0.5)}


def _muon_adamw(module: Regression) -> Any:
    # Muon for the hidden matrices, AdamW for the rest: the split torch's documentation recommends.
    matrices = [p for p in module.parameters() if p.ndim == 2]
    others = [p for p in module.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.05, nesterov=False), torch.optim.AdamW(others, lr=0.01)]


def _adafactor(module: Regression) -> Any:
    return torch.optim.Adafactor(module.parameters(), lr=0.05, weight_decay=0.01)


def _hf_adafactor(module: Regression) -> Any:
    from transformers.optimization import Adafactor

    # T5 fine-tuning's settings: relative step sizes, parameter scaling, update clipping.
    return Adafactor(module.parameters(), lr=None, relative_step=True, scale_parameter=True, warmup_init=False)


def _hf_adafactor_beta1(module: Regression) -> Any:
    from transformers.optimization import Adafactor

    return Adafactor(module.parameters(), lr=0.01, relative_step=False, scale_parameter=False, beta1=0.9)


OPTIMIZERS = {
    "muon": _muon,
    "muon_adamw": _muon_adamw,
    "adafactor": _adafactor,
    "hf_adafactor": _hf_adafactor,
    "hf_adafactor_beta1": _hf_adafactor_beta1,
}

# Every optimizer class torch.optim has, with the arguments a user would pass (the defaults where they train).
TORCH_OPTIMIZERS = {
    name: {"SGD": {"lr": 0.1, "momentum": 0.9}, "ASGD": {"lr": 0.05}, "Adagrad": {"lr": 0.05}}.get(name, {})
    for name in sorted(dir(torch.optim))
    if isinstance(getattr(torch.optim, name), type)
    and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
    and getattr(torch.optim, name) is not torch.optim.Optimizer
}


def _torch_optimizer(module: Regression) -> Any:
    name = module.hparams.optimizer.removeprefix("torch.optim.")
    return getattr(torch.optim, name)(module.parameters(), **TORCH_OPTIMIZERS[name])


# Regularizers written in training_step from the parameters, as under DDP.
PENALTIES = ("none", "l2", "distance", "anchored", "penalty_only")


class Regression(L.LightningModule):
    """A bias-free MLP for Muon (which takes matrices only), with biases and a norm for the others."""

    def __init__(
        self, optimizer: str = "muon", penalty: str = "none", manual: bool = False, index_write: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        bias = optimizer in OPTIMIZERS and optimizer != "muon"  # Muon, and the walk over torch.optim, without
        layers = [nn.Linear(12, 30, bias=bias), nn.GELU(), nn.Linear(30, 18, bias=bias), nn.GELU()]
        if bias:
            layers.append(nn.LayerNorm(18))
        self.net = nn.Sequential(*layers, nn.Linear(18, 5, bias=bias))
        self.automatic_optimization = not manual
        self.start: list[torch.Tensor] = []

    def on_train_start(self) -> None:
        self.start = [p.detach().clone() for p in self.parameters()]

    def _penalty(self) -> torch.Tensor:
        if self.hparams.penalty in ("l2", "penalty_only"):
            return 1e-2 * sum(p.pow(2).sum() for p in self.parameters())
        if self.hparams.penalty == "anchored":  # the mean squared distance, with torch's own loss function
            return sum(nn.functional.mse_loss(p, p0) for p, p0 in zip(self.parameters(), self.start))
        # L2-SP: the distance to the weights training started from.
        return 1e-1 * sum((p - p0).pow(2).sum() for p, p0 in zip(self.parameters(), self.start))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs), targets)
        if self.hparams.penalty != "none":
            penalty = self._penalty()
            self.log("penalty", penalty)
            self.log("penalty_value", penalty.item())  # a number read in training_step, as DDP's rank 0 reads it
            low, high = torch.aminmax(self.net[0].weight)
            self.log("weight_range", high - low)
            loss = penalty if self.hparams.penalty == "penalty_only" else loss + penalty
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.5)  # clips: the gradients' norm is above 1
        for optimizer in optimizers:
            optimizer.step()
        with torch.no_grad():  # a max-norm constraint on each output unit, after the step
            for layer in (m for m in self.net if isinstance(m, nn.Linear)):
                layer.weight.copy_(torch.renorm(layer.weight, 2, 0, 1.0))
            self.net[0].weight[0] = 0.0  # a pruned unit, by assignment
            if self.hparams.index_write:  # a view under DDP; a copy of rows under FSDP2
                self.net[0].weight[1].mul_(0.5)
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)
        if self.hparams.penalty != "none":  # computed from the parameters outside any training, as under DDP
            self.log("val_penalty", self._penalty(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return OPTIMIZERS.get(self.hparams.optimizer, _torch_optimizer)(self)
