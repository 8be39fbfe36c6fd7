"""Callbacks and a CheckpointIO plugin that tests use to change or watch a run from outside the module."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO

from testkit.distributed import full

__all__ = ["DropGradsAt", "RecordingIO", "StartState"]


class DropGradsAt(L.Callback):
    """Drops every gradient before the optimizer step at ``step``: a skipped step made without the guard."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            for param in pl_module.parameters():
                param.grad = None


class RecordingIO(CheckpointIO):
    """A user's CheckpointIO: ``torch.save`` with an extra key, and a log of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.calls.append(("save", os.path.basename(path), storage_options))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({**checkpoint, "saved_by": "RecordingIO"}, path)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.calls.append(("load", os.path.basename(path), weights_only))
        return torch.load(path, map_location="cpu", weights_only=False)

    def remove_checkpoint(self, path: Any) -> None:
        self.calls.append(("remove", os.path.basename(path)))
        os.remove(path)

    def teardown(self) -> None:
        self.calls.append(("teardown",))


class StartState(L.Callback):
    """The parameters and optimizer state a (resumed) run starts from, whole, by name: what two resumes compare."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        self.params = {name: full(p).detach().clone() for name, p in pl_module.named_parameters()}
        self.optimizer = {
            name: {key: full(value).clone() for key, value in optimizer.state[p].items()}
            for name, p in pl_module.named_parameters()
            if p in optimizer.state
        }
