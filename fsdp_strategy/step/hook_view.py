"""What ``on_before_optimizer_step`` sees: whole parameters with their whole, reduced gradients, as under DDP.

Between backward and the optimizer step a sharded module's parameters and gradients are DTensor shards. Code
written for DDP reads them in that hook (Lightning's ``grad_norm`` recipe, custom clipping, a NaN check) and
fails on a DTensor ("The tensor has a non-zero number of elements, but its data is not allocated yet") or
computes with one rank's shard. :class:`WholeParameters` shows the hooks what DDP shows: while they run, each
sharded parameter of the module is replaced by a plain ``nn.Parameter`` holding its full value and full
gradient; afterwards the module gets its shards back, and whatever the hooks changed (a gradient scaled,
replaced or set to ``None``, a parameter's value) is written into this rank's shards. Gathering costs one
all-gather of the parameters and gradients per optimizer step, and as much memory as they take whole, for
the duration of the hooks; it is done only when a hook is overridden (:func:`hooks_read_parameters`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_strategy._compat import tensor_version

__all__ = ["WholeParameters", "hooks_read_parameters", "whole_bytes"]

HOOK = "on_before_optimizer_step"


def hooks_read_parameters(module: nn.Module, callbacks: list[Callback]) -> list[str]:
    """Who overrides ``on_before_optimizer_step``: the module and callbacks by class name (empty: nobody)."""
    from lightning.pytorch import LightningModule

    found = [type(module).__name__] if isinstance(module, LightningModule) and is_overridden(HOOK, module, LightningModule) else []
    return found + [type(c).__name__ for c in callbacks if is_overridden(HOOK, c, Callback)]


def whole_bytes(module: nn.Module) -> int:
    """Bytes the whole parameters and gradients take while the hooks see them."""
    params = {id(p): p for p in module.parameters() if isinstance(p, DTensor)}.values()
    return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in params)


@dataclass
class _Swapped:
    sharded: DTensor
    whole: nn.Parameter
    version: int
    grad: Tensor | None
    grad_version: int | None


class WholeParameters:
    """Swaps ``module``'s sharded parameters for whole ones between :meth:`open` and :meth:`close` (see the module
    docstring). Both are collective-free on close; :meth:`open` gathers, so every rank calls it at the same point."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._swapped: dict[int, _Swapped] = {}
        self._places: list[tuple[nn.Module, str, DTensor]] = []

    def open(self) -> None:
        with torch.no_grad():
            for owner in self.module.modules():  # the same order on every rank: each full_tensor() is a collective
                for name, param in list(owner._parameters.items()):
                    if not isinstance(param, DTensor):
                        continue
                    if id(param) not in self._swapped:
                        self._swapped[id(param)] = _gather(param)
                    owner._parameters[name] = self._swapped[id(param)].whole
                    self._places.append((owner, name, param))

    def close(self) -> None:
        for owner, name, param in self._places:
            owner._parameters[name] = param
        with torch.no_grad():
            for swapped in self._swapped.values():
                _write_back(swapped)
        self._places, self._swapped = [], {}


def _gather(param: DTensor) -> _Swapped:
    whole = nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad)
    grad = None
    if param.grad is not None:
        grad = param.grad.full_tensor()
        whole.grad = grad
    return _Swapped(param, whole, tensor_version(whole), grad, None if grad is None else tensor_version(grad))


def _write_back(swapped: _Swapped) -> None:
    sharded, whole = swapped.sharded, swapped.whole
    if tensor_version(whole) != swapped.version:
        sharded.to_local().copy_(_shard(whole.detach(), sharded).to_local())
    sharded.requires_grad_(whole.requires_grad)
    grad = whole.grad
    if grad is None:
        sharded.grad = None
    elif grad is not swapped.grad or tensor_version(grad) != swapped.grad_version:
        shard = _shard(grad, sharded)
        if sharded.grad is None:
            sharded.grad = shard
        else:
            sharded.grad.to_local().copy_(shard.to_local())


def _shard(value: Tensor, like: DTensor) -> Any:
    # Every rank holds the same whole tensor: each keeps its own shard, without communication.
    local = value.to(device=like.to_local().device, dtype=like.dtype)
    return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)
