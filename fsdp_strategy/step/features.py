"""The per-step features of a stage as one :class:`~fsdp_strategy.step.hooks.StepHooks` list, in the order
each point of a step calls them (the order of their collectives, the same on every rank)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from fsdp_strategy.modes import HostMemory
from fsdp_strategy.step.buffer_sync import BufferSyncHook
from fsdp_strategy.step.guard import GuardHook, NonFiniteGuard
from fsdp_strategy.step.hooks import StepHook, StepHooks
from fsdp_strategy.step.release import ReleaseHook
from fsdp_strategy.step.sharded_step import ShardedStepHook
from fsdp_strategy.step.unit_order import UnitOrder, UnitOrderHook
from fsdp_strategy.step.unused import UnusedHook, UnusedParameters

__all__ = ["step_hooks"]


def step_hooks(
    model: nn.Module,
    *,
    host_memory: HostMemory,
    fitting: bool,
    guard: NonFiniteGuard,
    precision: Precision,
    device: torch.device,
    host_group: Any,
    gathered: list[tuple[Tensor, Tensor]] | None,
) -> StepHooks:
    """The features that apply to ``model`` in this stage (``fitting``: ``Trainer.fit``)."""
    hooks: list[StepHook] = []
    if guard.active:  # it only wraps the optimizer's closure: first, before anything acts at that point
        hooks.append(GuardHook(guard, device=device, precision=precision))
    if fitting:
        hooks.append(BufferSyncHook(model))
    if host_memory == HostMemory.RELEASE:
        hooks.append(ReleaseHook())
    if isinstance(model, FSDPModule):
        hooks.append(ShardedStepHook(model))
    order = UnitOrder.attach(model, group=host_group)
    if order is not None:
        hooks.append(UnitOrderHook(order))
    if fitting:  # after the unit order: the units' digest travels in its record
        hooks.append(UnusedHook(UnusedParameters(model, group=host_group, gathered=gathered), order))
    return StepHooks(hooks)
