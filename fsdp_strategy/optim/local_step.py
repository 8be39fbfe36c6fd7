"""An elementwise optimizer's own step on this rank's local tensors, for one whose ops DTensor does not cover.

``torch.optim.Rprop`` is elementwise, but its sign masks (``grad[sign.eq(etaminus)] = 0``) are an ``index_put_`` that
DTensor refuses on a shard ("in-place operations that require placement changes are not supported"). On local
tensors every op is a plain tensor op, and since the update reads each element alone the shards step as the whole
parameter would. For the step only, each parameter, its gradient and its state are swapped for their local tensors
(sharing memory); afterwards the state entries are DTensors laid out as the parameter again, so checkpoints see the
layout any elementwise optimizer's state has.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["check", "step"]


def check(optimizer: Optimizer) -> None:
    """Any layout: an elementwise update is exact on whatever part of a parameter a rank holds."""


def step(optimizer: Optimizer) -> None:
    swapped = _swap_to_local(optimizer)
    try:
        # The class's own step, unwrapped from torch's hook wrapper: the installed step already ran the hooks.
        inspect.unwrap(type(optimizer).step)(optimizer)
    finally:
        _swap_back(optimizer, swapped)


def _swap_to_local(optimizer: Optimizer) -> list[tuple[list[Tensor], int, DTensor, Tensor]]:
    swapped = []
    for group in optimizer.param_groups:
        params = group["params"]
        for index, param in enumerate(params):
            if not isinstance(param, DTensor):
                continue
            with torch.no_grad():
                local = param.to_local()
            local.grad = param.grad.to_local() if param.grad is not None else None
            if param in optimizer.state:
                entries = optimizer.state.pop(param)
                optimizer.state[local] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entries.items()}
            params[index] = local
            swapped.append((params, index, param, local))
    return swapped


def _swap_back(optimizer: Optimizer, swapped: list[tuple[list[Tensor], int, DTensor, Tensor]]) -> None:
    for params, index, param, local in swapped:
        params[index] = param
        local.grad = None
        if local in optimizer.state:
            entries = optimizer.state.pop(local)
            optimizer.state[param] = {k: _as_param_layout(v, local, param) for k, v in entries.items()}


def _as_param_layout(value: Any, local: Tensor, param: DTensor) -> Any:
    if not isinstance(value, Tensor) or value.ndim == 0 or value.shape != local.shape:
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
