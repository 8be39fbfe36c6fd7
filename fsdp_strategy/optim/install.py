"""Each optimizer of a stage classified once, and the distributed steps put in place of the optimizers' own.

An optimizer's ``step`` is replaced on the instance, where torch's LR schedulers also wrap it, so every caller
reaches it: Lightning's precision plugins in automatic optimization, ``self.optimizers().step()`` in manual
optimization, a gradient scaler, user code holding the optimizer. It is wrapped in torch's
``Optimizer.profile_hook_step`` as the class's own ``step`` is, so the step hooks registered on the optimizer still run.
After the stage the optimizer's own ``step`` is back. The state stays in ``optimizer.state`` under the optimizer's
own keys, so checkpoints save and load it as any other (:mod:`fsdp_strategy.checkpoint.optimizer_state`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from fsdp_strategy._compat import lr_scheduler_aware
from fsdp_strategy.optim import adafactor, local_step, muon
from fsdp_strategy.optim.kinds import LOCAL_STEP, OptimizerKind, class_path, classify

__all__ = ["DISTRIBUTED", "DistributedStep", "ShardedOptimizers"]


@dataclass(frozen=True)
class DistributedStep:
    """``check(optimizer)`` raises before training for what the step cannot run exactly (a tensor-parallel
    layout); ``step(optimizer)`` updates the parameters as ``optimizer.step`` would, the same on every rank (the
    closure, if any, has run)."""

    check: Callable[[Optimizer], None]
    step: Callable[[Optimizer], None]


DISTRIBUTED: dict[str, DistributedStep] = {
    "torch.optim.Muon": DistributedStep(muon.check, muon.step),
    "torch.optim.Adafactor": DistributedStep(adafactor.check_torch, adafactor.torch_step),
    "transformers.optimization.Adafactor": DistributedStep(adafactor.check_transformers, adafactor.transformers_step),
    **{path: DistributedStep(local_step.check, local_step.step) for path in LOCAL_STEP},
}


class ShardedOptimizers:
    """The optimizers of one stage: ``adopt`` classifies (raising for an unsupported one) and installs,
    ``release`` gives each its own ``step`` back."""

    def __init__(self, declared_elementwise: Iterable[str] = ()) -> None:
        self.declared = frozenset(declared_elementwise)
        self.kinds: dict[int, OptimizerKind] = {}
        self._installed: list[tuple[Optimizer, Any]] = []  # with the instance `step` each had before

    def adopt(self, optimizers: Iterable[Optimizer]) -> None:
        """Classifies each optimizer not seen yet and, where it runs distributed, checks and installs its step."""
        for optimizer in optimizers:
            if id(optimizer) in self.kinds:
                continue
            kind = classify(optimizer, distributed=DISTRIBUTED.keys(), declared=self.declared)
            if kind == OptimizerKind.DISTRIBUTED:
                distributed = DISTRIBUTED[class_path(optimizer)]
                distributed.check(optimizer)
                self._install(optimizer, distributed.step)
            self.kinds[id(optimizer)] = kind

    def _install(self, optimizer: Optimizer, step: Callable[[Optimizer], None]) -> None:
        def distributed_step(self: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
            # As torch's optimizers: the closure (forward and backward) first, with gradients on.
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            step(self)
            return loss

        distributed_step.__qualname__ = f"{type(optimizer).__qualname__}.step"
        before = optimizer.__dict__.get("step")
        hooked = lr_scheduler_aware(Optimizer.profile_hook_step(distributed_step), before)
        self._installed.append((optimizer, before))
        optimizer.step = types.MethodType(hooked, optimizer)  # type: ignore[method-assign]

    def release(self) -> None:
        for optimizer, before in reversed(self._installed):
            if before is None:
                optimizer.__dict__.pop("step", None)
            else:
                optimizer.step = before  # type: ignore[method-assign]
        self._installed, self.kinds = [], {}
