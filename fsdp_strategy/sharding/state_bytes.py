"""Bytes of model state: a module's parameters, their gradients and its optimizers' state.

Two sizes of the same tensors: :func:`held_bytes`, what this rank holds (a DTensor's local shard),
and :func:`full_bytes`, what the tensors take whole (a DTensor's global shape, as a full state dict
gathers it). Which tensors count is :func:`model_state_tensors`' one answer, for the monitor, the
gathering of a sharded module, the benchmark and the tests that compare with the estimator.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["full_bytes", "held_bytes", "model_state_bytes", "model_state_tensors", "optimizer_state_tensors"]


def held_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes this rank holds of ``tensors``: a DTensor's local shard, any other tensor whole."""
    return sum(_stored_bytes(tensor.to_local() if isinstance(tensor, DTensor) else tensor) for tensor in tensors)


def _stored_bytes(tensor: Tensor) -> int:
    # A tensor subclass that wraps others (torchao's NF4 tensor: 4-bit codes and their scales) reports the dtype it
    # stands for; the bytes are those of the tensors inside it.
    if not isinstance(tensor, DTensor) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def full_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes ``tensors`` take whole: a DTensor at its global shape, any other tensor as it is."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def optimizer_state_tensors(optimizers: Iterable[torch.optim.Optimizer], *, scalar_state: bool = True) -> list[Tensor]:
    """The tensors the optimizers keep per parameter (Adam's moments, SGD's momentum...).

    ``scalar_state=False`` leaves out 0-dim ones (Adam's step counters): the estimator does not model
    them, and sharding does not divide them."""
    return [
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, Tensor) and (scalar_state or value.dim() > 0)
    ]


def model_state_tensors(
    module: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    *,
    gradients: bool = True,
    scalar_state: bool = True,
) -> list[Tensor]:
    """``module``'s parameters (a tied one once), their gradients where they have one (unless
    ``gradients=False``) and the optimizers' state (see :func:`optimizer_state_tensors`)."""
    params = list(module.parameters())  # parameters() yields a tied parameter once
    grads = [p.grad for p in params if p.grad is not None] if gradients else []
    return [*params, *grads, *optimizer_state_tensors(optimizers, scalar_state=scalar_state)]


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], *, scalar_state: bool = True
) -> int:
    """Bytes this rank holds of parameters, their gradients and optimizer state (local shards only)."""
    return held_bytes(model_state_tensors(module, optimizers, scalar_state=scalar_state))
