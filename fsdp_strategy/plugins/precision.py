"""``Trainer(precision=...)`` as Lightning precision plugins that run on sharded parameters.

The FSDP2 policy each ``*-mixed`` precision shards with is :mod:`fsdp_strategy.sharding.mixed_precision`'s; the
plugins add autocast (as under DDP), loss scaling that agrees across ranks, and the whole parameters that
``on_before_optimizer_step`` sees.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from lightning.pytorch.plugins.precision import (
    BitsandbytesPrecision,
    DeepSpeedPrecision,
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    TransformerEnginePrecision,
    XLAPrecision,
)
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fsdp_strategy.plugins.clipping import clip_grad_norm
from fsdp_strategy.step.whole_reads import plain_tensors

__all__ = [
    "FSDP2_PLUGINS",
    "SUPPORTED_PRECISIONS",
    "forget_module",
    "precision_plugin_for",
    "strategy_plugin",
    "translate_trainer_plugin",
]

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


def precision_plugin_for(precision: str, device_type: str) -> Precision:
    """The Lightning precision plugin that runs ``precision`` on sharded parameters.

    Raises:
        ValueError: ``precision`` is not one of :data:`SUPPORTED_PRECISIONS`.
    """
    if precision in ("bf16-mixed", "16-mixed"):
        return FSDP2MixedPrecision(precision, device_type)  # type: ignore[arg-type]
    if precision in ("bf16-true", "16-true"):
        return FSDP2HalfPrecision(precision)  # type: ignore[arg-type]
    if precision == "32-true":
        return FSDP2Precision()
    if precision == "64-true":
        return FSDP2DoublePrecision()
    raise ValueError(
        f"`Trainer(precision={precision!r})` is not supported by the FSDP2 strategy. Choose one of:"
        f" {', '.join(SUPPORTED_PRECISIONS)}."
    )


class ParameterView(Protocol):
    """What the plugins open around ``on_before_optimizer_step`` (:class:`~fsdp_strategy.sharding.hook_view.WholeParameters`):
    a protocol, so that the plugins need not import the sharding package."""

    def open(self) -> None: ...

    def reads(self, hook: str) -> bool: ...

    def as_seen(self, params: list[Tensor]) -> list[Tensor]: ...

    def close(self) -> None: ...


class _WholeParametersInHooks:
    """Runs the hooks that read gradients (``on_after_backward``, ``on_before_optimizer_step``,
    ``configure_gradient_clipping``) with the whole parameters and gradients of :attr:`hook_view`
    (:class:`~fsdp_strategy.sharding.hook_view.WholeParameters`, set by the strategy; ``None``: the shards as they are).

    Lightning's ``Precision._after_closure`` calls ``on_before_optimizer_step`` and then ``_clip_gradients``, which
    calls ``configure_gradient_clipping``: both see one view, so clipping works on whole gradients as under DDP and
    what it changed is written into the shards when the view closes.
    """

    hook_view: ParameterView | None = None

    def pre_backward(self, tensor: Any, module: Any) -> Any:
        # A manual_backward of a penalty alone, a DTensor computed from the shards in training_step, backpropagates
        # as DDP's plain loss (here, not in the strategy's `backward`: Lightning's tests wrap `Strategy.backward`).
        return super().pre_backward(plain_tensors(tensor), module)  # type: ignore[misc]

    def post_backward(self, tensor: Any, module: Any) -> Any:
        if self.hook_view is None or not self.hook_view.reads("on_after_backward"):
            return super().post_backward(tensor, module)  # type: ignore[misc]
        self.hook_view.open()
        try:
            return super().post_backward(tensor, module)  # type: ignore[misc]
        finally:
            self.hook_view.close()

    def main_params(self, optimizer: Any) -> Any:
        # What `clip_gradients` clips: the whole parameters while the hooks see them, so that they see the result.
        params = list(super().main_params(optimizer))  # type: ignore[misc]
        return params if self.hook_view is None else self.hook_view.as_seen(params)

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        view = self.hook_view
        if view is None or not (view.reads("on_before_optimizer_step") or view.reads("configure_gradient_clipping")):
            return super()._after_closure(model, optimizer)  # type: ignore[misc]
        self.hook_view.open()
        try:
            super()._after_closure(model, optimizer)  # type: ignore[misc]
        finally:
            self.hook_view.close()

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        # Across the meshes of tensor-parallel and data-parallel parameters alike (see plugins.clipping).
        clip_grad_norm(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]


class FSDP2Precision(_WholeParametersInHooks, Precision):
    """``"32-true"``."""


class FSDP2DoublePrecision(_WholeParametersInHooks, DoublePrecision):
    """``"64-true"``: parameters, gradients and optimizer state in float64, sharded like any others."""


class FSDP2HalfPrecision(_WholeParametersInHooks, HalfPrecision):
    """``"bf16-true"`` / ``"16-true"``: parameters, gradients and optimizer state in the low dtype."""


class FSDP2MixedPrecision(_WholeParametersInHooks, MixedPrecision):
    """``"bf16-mixed"`` / ``"16-mixed"``: autocast over fp32 master weights.

    fp16 needs loss scaling; its "found inf" flag must agree across ranks, or ranks whose shard
    overflowed would skip a step the others take. ``ShardedGradScaler`` all-reduces that flag.
    """

    def __init__(self, precision: str, device_type: str) -> None:
        scaler = ShardedGradScaler(device=device_type) if precision == "16-mixed" else None
        super().__init__(precision, device_type, scaler=scaler)  # type: ignore[arg-type]


FSDP2_PLUGINS = (FSDP2Precision, FSDP2DoublePrecision, FSDP2HalfPrecision, FSDP2MixedPrecision)

# Lightning's own plugins, one of which its connector builds from `Trainer(precision=...)` for a strategy it has
# no plugin class for: they carry the precision the user chose, which becomes one of FSDP2_PLUGINS.
_LIGHTNING_PLUGINS = (
    Precision,
    MixedPrecision,
    HalfPrecision,
    DoublePrecision,
    TransformerEnginePrecision,
    BitsandbytesPrecision,
    FSDPPrecision,
    DeepSpeedPrecision,
    XLAPrecision,
)


def translate_trainer_plugin(plugin: Precision, *, strategy: str, explicit_mp_policy: bool) -> Precision:
    """The FSDP2 plugin for the precision of Lightning's ``plugin``.

    Raises:
        TypeError: ``plugin`` is not one of Lightning's own (a custom plugin cannot run on shards).
        ValueError: its precision is not one of :data:`SUPPORTED_PRECISIONS`, or conflicts with ``mp_policy``.
    """
    precision = getattr(plugin, "precision", None)
    if type(plugin) not in _LIGHTNING_PLUGINS:
        raise TypeError(
            f"{strategy} does not take custom precision plugins; got {type(plugin).__name__}."
            f" Use `Trainer(precision=...)` with one of: {', '.join(SUPPORTED_PRECISIONS)}, or pass"
            " `mp_policy=` to the strategy."
        )
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"{strategy} does not support `Trainer(precision={precision!r})`"
            f" ({type(plugin).__name__}). Choose one of: {', '.join(SUPPORTED_PRECISIONS)}."
        )
    if explicit_mp_policy and precision != "32-true":
        raise ValueError(
            f"Conflicting precision settings: `mp_policy` was given to {strategy} and"
            f" `Trainer(precision={precision!r})` too. Pass one of them: keep `mp_policy` with"
            " precision='32-true', or drop `mp_policy`."
        )
    device_type = getattr(plugin, "device", "cuda" if torch.cuda.is_available() else "cpu")
    return precision_plugin_for(precision, device_type)


def strategy_plugin(plugin: Precision, *, strategy: str, mp_policy: MixedPrecisionPolicy | None) -> Precision:
    """The plugin a strategy keeps when ``plugin`` is set on it: one of :data:`FSDP2_PLUGINS` as it is; one of Lightning's own, which its connector builds from ``Trainer(precision=...)`` for a strategy it has no
    plugin class for, translated by :func:`translate_trainer_plugin` (the same precision on shards, or the error
    that names what is supported); ``mp_policy`` is the strategy's option."""
    if isinstance(plugin, FSDP2_PLUGINS):
        return plugin
    return translate_trainer_plugin(plugin, strategy=strategy, explicit_mp_policy=mp_policy is not None)


def forget_module(plugin: Precision | None) -> None:
    """Drops the whole-parameter view a stage gave ``plugin``: it holds the module."""
    if isinstance(plugin, FSDP2_PLUGINS):
        plugin.hook_view = None
