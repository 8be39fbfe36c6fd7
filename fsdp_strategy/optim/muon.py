"""``torch.optim.Muon``'s step on row shards, equal to its step on whole matrices.

Muon's momentum is elementwise and runs on each rank's rows. Its orthogonalization (Newton-Schulz) is a function of
the whole matrix: each matrix is orthogonalized once, by an owner rank (:mod:`.owners`), with torch's own
Newton-Schulz and coefficients; the learning-rate adjustment reads the global shape, as torch's does on a whole
parameter. Every line follows ``torch.optim._muon._single_tensor_muon`` (torch 2.9 to 2.15).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fsdp_strategy._compat import muon_functions
from fsdp_strategy.optim.owners import apply_whole
from fsdp_strategy.optim.rows import row_shards

__all__ = ["check", "step"]


def check(optimizer: Optimizer) -> None:
    """Every parameter laid out by rows (raises :class:`~.rows.UnsupportedLayout` naming the fix otherwise)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            row_shards(param, optimizer="torch.optim.Muon")


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def _update(optimizer: Optimizer, group: dict[str, Any]) -> None:
    newton_schulz, adjust_lr, to_scalar = muon_functions()
    lr, weight_decay, momentum = to_scalar(group["lr"]), group["weight_decay"], group["momentum"]
    params, updates, layouts = [], [], []
    for param in group["params"]:
        if param.grad is None:
            continue
        if torch.is_complex(param):
            raise RuntimeError("Muon does not support complex parameters")
        if param.grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        if param.grad.ndim != 2:
            raise ValueError("Param gradient must be a 2D matrix")
        state = optimizer.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
        grad, buf = _local(param.grad), _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - momentum)
        updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
        params.append(param)
        layouts.append(row_shards(param, optimizer="torch.optim.Muon"))

    coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
    orthogonalized = apply_whole(updates, layouts, lambda whole: newton_schulz(whole, coefficients, steps, eps))
    for param, update in zip(params, orthogonalized):
        adjusted_lr = adjust_lr(lr, group["adjust_lr_fn"], param.shape)  # the global shape, as on a whole parameter
        local = _local(param)
        local.mul_(1 - lr * weight_decay)
        local.add_(update, alpha=-adjusted_lr)


def step(optimizer: Optimizer) -> None:
    for group in optimizer.param_groups:
        _update(optimizer, group)
