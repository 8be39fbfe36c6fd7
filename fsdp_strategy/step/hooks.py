"""``StepHook``: the points of a step where a per-step feature acts, and ``StepHooks``, the list the strategy calls.

The strategy builds the list once per stage (only the features that apply) and calls every hook in list order
at each point, except :meth:`StepHooks.close`, which goes in reverse. Every rank builds the same list, so the
collectives the hooks issue come in the same order everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["StepHook", "StepHooks"]


class StepHook:
    """No-op points of a step; a feature overrides those it acts at. ``manual``: the step runs under manual
    optimization (``automatic_optimization = False``), where the strategy steps inside ``training_step``."""

    def before_forward(self) -> None:
        """Before a training or validation step's forward."""

    def after_forward(self, *, training: bool, gradient_sync: bool) -> None:
        """After a training (``training``) or validation step's forward returned; ``gradient_sync``: its
        gradients will be reduced (gradients enabled, automatic optimization, outside ``no_sync``)."""

    def after_training_step(self, *, manual: bool) -> None:
        """After ``training_step``, also when it raised."""

    def after_evaluation_step(self, during: str) -> None:
        """After a validation, test or predict step (``during`` names it)."""

    def before_backward(self, loss: Tensor, *, manual: bool) -> None:
        """Before a backward of ``loss``."""

    def after_backward(self, *, reduced: bool) -> None:
        """After a backward; ``reduced``: its reduced gradients reached ``param.grad`` (not a ``no_sync``
        micro-batch, nor one under hybrid sharding whose all-reduce waits for the last micro-batch)."""

    def wrap_closure(self, closure: Callable[[], Any], optimizer: Optimizer, module: nn.Module) -> Callable[[], Any]:
        """The closure (forward and backward) an optimizer step is to run."""
        return closure

    def before_optimizer_step(self, *, manual: bool) -> None:
        """Before the optimizer steps (and runs the closure)."""

    def after_optimizer_step(self, *, manual: bool) -> None:
        """After the optimizer stepped."""

    def stage_ended(self) -> None:
        """The stage ended normally on every rank; before the module is given back."""

    def close(self, *, wait: bool) -> None:
        """The stage is over (or the module is given back); ``wait``: pending collectives may be awaited."""


class StepHooks:
    """The hooks of a stage, called in order."""

    def __init__(self, hooks: Sequence[StepHook] = ()) -> None:
        self.hooks = list(hooks)

    def __iter__(self) -> Any:
        return iter(self.hooks)

    def before_forward(self) -> None:
        for hook in self.hooks:
            hook.before_forward()

    def after_forward(self, *, training: bool, gradient_sync: bool) -> None:
        for hook in self.hooks:
            hook.after_forward(training=training, gradient_sync=gradient_sync)

    def after_training_step(self, *, manual: bool) -> None:
        for hook in self.hooks:
            hook.after_training_step(manual=manual)

    def after_evaluation_step(self, during: str, output: Any) -> Any:
        """Returns ``output``, the step's, once every hook has acted (before it reaches the metrics or the caller)."""
        for hook in self.hooks:
            hook.after_evaluation_step(during)
        return output

    def before_backward(self, loss: Tensor, *, manual: bool) -> None:
        for hook in self.hooks:
            hook.before_backward(loss, manual=manual)

    def after_backward(self, *, reduced: bool) -> None:
        for hook in self.hooks:
            hook.after_backward(reduced=reduced)

    def wrap_closure(self, closure: Callable[[], Any], optimizer: Optimizer, module: nn.Module) -> Callable[[], Any]:
        for hook in self.hooks:
            closure = hook.wrap_closure(closure, optimizer, module)
        return closure

    def before_optimizer_step(self, *, manual: bool) -> None:
        for hook in self.hooks:
            hook.before_optimizer_step(manual=manual)

    def after_optimizer_step(self, *, manual: bool) -> None:
        for hook in self.hooks:
            hook.after_optimizer_step(manual=manual)

    def stage_ended(self) -> None:
        for hook in self.hooks:
            hook.stage_ended()

    def close(self, *, wait: bool) -> None:
        """Closes every hook, the last built first, and empties the list: closing twice is a no-op."""
        hooks, self.hooks = self.hooks, []
        for hook in reversed(hooks):
            hook.close(wait=wait)
