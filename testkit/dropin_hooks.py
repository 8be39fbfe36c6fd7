"""What ordinary Lightning code reads from its module during a fit: the gradients and parameters of each hook that
hands them to user code, the model summary, optimizers that train nothing, go unused or come later.
``integration_tests/dropin_hooks_worker.py`` runs them under ``fsdp2`` and DDP.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.model_summary import summarize
from torch import Tensor

from testkit.models import TinyLM


def whole_gradients(module: torch.nn.Module) -> dict[str, Tensor]:
    """Each gradient as user code reads it: a copy on the CPU (a DTensor is left out: it cannot be compared)."""
    return {
        name: p.grad.detach().clone().cpu()
        for name, p in module.named_parameters()
        if p.grad is not None and type(p.grad) is Tensor
    }


def tensor_classes(module: torch.nn.Module) -> list[str]:
    """The classes of the parameters and of their gradients."""
    params = list(module.parameters())
    return sorted({type(p).__name__ for p in params} | {type(p.grad).__name__ for p in params if p.grad is not None})


class HookReader(TinyLM):
    """Reads the gradients in every hook that hands them over, and after clipping checks them against the clipping
    value with plain tensors, as user code does (a DTensor there fails: "Comparing a DTensor to a non-DTensor")."""

    def __init__(self) -> None:
        super().__init__(n_layer=2)
        self.seen: dict[str, list[Any]] = defaultdict(list)

    def on_after_backward(self) -> None:
        self.seen["on_after_backward"].append((tensor_classes(self), whole_gradients(self)))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.seen["on_before_optimizer_step"].append((tensor_classes(self), whole_gradients(self)))

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm=None
    ) -> None:  # type: ignore[no-untyped-def]
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        limit = torch.tensor(gradient_clip_val, dtype=grads[0].dtype)
        if gradient_clip_algorithm == "value":
            within = all(bool((g.abs() <= limit).all()) for g in grads)
        else:
            within = bool(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) <= limit * (1 + 1e-6))
        self.seen["configure_gradient_clipping"].append((tensor_classes(self), whole_gradients(self), within))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self.seen["optimizer_step"].append(tensor_classes(self))
        super().optimizer_step(*args, **kwargs)


class CallbackReader(L.Callback):
    """A callback's view of the same hooks."""

    def __init__(self) -> None:
        self.seen: dict[str, list[Any]] = defaultdict(list)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen["on_after_backward"].append((tensor_classes(pl_module), whole_gradients(pl_module)))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.seen["on_before_optimizer_step"].append((tensor_classes(pl_module), whole_gradients(pl_module)))


def summary_fields(module: L.LightningModule) -> dict[str, Any]:
    """What ``ModelSummary`` shows of ``module``: layer names and types, parameter counts, model size."""
    summary = summarize(module, max_depth=-1)
    return {
        "names": summary.layer_names,
        "types": summary.layer_types,
        "params": summary.param_nums,
        "total": summary.total_parameters,
        "trainable": summary.trainable_parameters,
        "size_mb": summary.model_size,
    }


class SummaryReader(L.Callback):
    """The summary during the fit, as the ``ModelSummary`` callback reads it at its start."""

    def __init__(self) -> None:
        self.during: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.during = summary_fields(pl_module)


class OptimizerConfigs(TinyLM):
    """``configure_optimizers`` as users write it: ``"none"`` returns None (Lightning trains nothing); ``"unused"``
    returns two optimizers under manual optimization and steps the first only; ``"later"`` returns None until
    :class:`AddOptimizer` asks for AdamW, a choice kept in the checkpoint so that a resumed fit builds it too."""

    def __init__(self, mode: str) -> None:
        super().__init__(n_layer=2)
        self.mode = mode
        self.with_optimizer = mode != "later"
        self.automatic_optimization = mode != "unused"

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        if self.mode == "unused":
            first, _ = self.optimizers()
            first.zero_grad()
            self.manual_backward(loss)
            first.step()
        return loss

    def configure_optimizers(self) -> Any:
        if self.mode == "none" or not self.with_optimizer:
            return None
        if self.mode == "unused":
            blocks = list(self.blocks.parameters())
            rest = [p for p in self.parameters() if all(p is not b for b in blocks)]
            return [torch.optim.AdamW(rest, lr=1e-2), torch.optim.AdamW(blocks, lr=1e-2)]
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["with_optimizer"] = self.with_optimizer

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.with_optimizer = checkpoint["with_optimizer"]


class AddOptimizer(L.Callback):
    """From the second epoch on, the module trains with an optimizer: ``setup_optimizers`` runs again."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch >= 1 and not pl_module.with_optimizer:
            pl_module.with_optimizer = True
            trainer.strategy.setup_optimizers(trainer)
