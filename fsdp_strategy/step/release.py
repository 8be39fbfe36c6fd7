"""``host_memory="release"``: the heap's free pages handed back at each phase end of a training step (glibc's
``malloc_trim``, through :mod:`fsdp_strategy.host_memory`; see there why it helps on CPU)."""

from __future__ import annotations

from fsdp_strategy.host_memory import release
from fsdp_strategy.step.hooks import StepHook

__all__ = ["ReleaseHook"]


class ReleaseHook(StepHook):
    """``host_memory='release'``: free heap pages handed back at each phase end of a training step."""

    def after_forward(self, *, training: bool, gradient_sync: bool) -> None:
        if training:  # the forward's freed buffers: holes the backward's may not fit
            release()

    def after_backward(self, *, reduced: bool) -> None:
        release()

    def after_optimizer_step(self, *, manual: bool) -> None:
        release()  # the step's buffers are free now, the next step's not yet taken
