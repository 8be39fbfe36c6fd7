"""Gradient clipping by norm over gradients that live on different device meshes.

Under tensor parallelism inside FSDP2 the layers split over the ``tensor_parallel`` dimension hold DTensors on the
2-D mesh, the others on its ``data_parallel`` dimension; ``torch.nn.utils.clip_grad_norm_`` stacks the norms of all
of them and DTensor refuses operands on different meshes. The norm is taken per mesh and made whole there (each
group's norm is a partial sum across its ranks), then combined, as over the full, unsplit gradients under DDP.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm", "total_grad_norm"]


def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type`` norm of all gradients of ``parameters``, a plain tensor equal on every rank."""
    norms = []
    for group in _by_mesh(parameters).values():
        norm = torch.nn.utils.get_total_norm([param.grad for param in group], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    return torch.nn.utils.get_total_norm(norms, norm_type)


def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scales the gradients of ``parameters`` so that their total norm is at most ``max_norm``; returns the norm
    before clipping, as ``torch.nn.utils.clip_grad_norm_``."""
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type)
    # One scaling per mesh: a foreach op over DTensors refuses operands on different meshes.
    for group in _by_mesh(parameters).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _by_mesh(parameters: Iterable[Tensor]) -> dict[object, list[Tensor]]:
    """The parameters that have a gradient, by the device mesh of their gradient (``None``: plain tensors)."""
    groups: dict[object, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    return groups
