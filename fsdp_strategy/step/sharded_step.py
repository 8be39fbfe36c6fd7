"""What a sharded root needs around steps that FSDP2's own hooks do not cover: evaluation forwards and manual
optimization, where units gathered by a forward without backward must not survive an update."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from fsdp_strategy._compat import reduce_root_gradients_after
from fsdp_strategy.sharding.parallelize import reshard_units
from fsdp_strategy.step.hooks import StepHook

__all__ = ["ShardedStepHook"]


class ShardedStepHook(StepHook):
    """What a sharded root needs around steps that FSDP2's own hooks do not cover: evaluation forwards and
    manual optimization, where units gathered by a forward without backward must not survive an update."""

    def __init__(self, model: FSDPModule) -> None:
        self.model = model

    def after_training_step(self, *, manual: bool) -> None:
        if manual:
            reshard_units(self.model)

    def after_evaluation_step(self, during: str) -> None:
        reshard_units(self.model)  # no backward frees the units kept gathered after forward

    def before_backward(self, loss: Tensor, *, manual: bool) -> None:
        if manual and loss.requires_grad:
            reduce_root_gradients_after(self.model, loss)

    def before_optimizer_step(self, *, manual: bool) -> None:
        if manual:  # a unit gathered by a forward without backward would keep its values from before this update
            reshard_units(self.model)

    def after_optimizer_step(self, *, manual: bool) -> None:
        if manual:
            # The root's own parameters were gathered when training_step began and resharded by the
            # backward that just ran; gather the updated shards so the rest of the step sees them.
            self.model.unshard()
