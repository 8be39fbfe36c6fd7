"""What the hooks that read gradients see: whole parameters with their whole, reduced gradients, as under DDP.

Between backward and the optimizer step a sharded module's parameters and gradients are DTensor shards. Code
written for DDP reads them in ``on_after_backward``, ``on_before_optimizer_step`` and
``configure_gradient_clipping`` (Lightning's ``grad_norm`` recipe, custom clipping, a NaN check, a gradient
compared with a plain tensor) and
fails on a DTensor ("The tensor has a non-zero number of elements, but its data is not allocated yet") or
computes with one rank's shard. :class:`WholeParameters` shows the hooks what DDP shows: while they run, each
sharded parameter of the module is replaced by a plain ``nn.Parameter`` holding its full value and full
gradient; afterwards the module gets its shards back, and whatever the hooks changed (a gradient scaled,
replaced or set to ``None``, a parameter's value) is written into this rank's shards. Gathering costs one
all-gather of the parameters and gradients per optimizer step (``on_before_optimizer_step`` and
``configure_gradient_clipping`` share one) and per backward (``on_after_backward``), and as much memory as they
take whole, for the duration of the hooks; each is done only when its hook is overridden
(:func:`hooks_read_parameters`).

``optimizer_step`` (the LightningModule's) is the one hook that sees the shards: the optimizer it is handed steps
them. A micro-batch that accumulates without reducing (``accumulate_grad_batches``) shows ``on_after_backward``
the gradients of the last reduction (``None`` after ``zero_grad``), where DDP shows the rank's local sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_strategy import host_memory
from fsdp_strategy._compat import tensor_version
from fsdp_strategy.launch.rendezvous import all_ranks_agree
from fsdp_strategy.sizes import format_bytes

__all__ = [
    "WholeParameters",
    "explain_sharded_view",
    "whole_parameters_in_hooks",
    "hooks_read_parameters",
    "whole_bytes",
]

# The hooks that see the view, and whether callbacks have them too (configure_gradient_clipping is the module's).
HOOKS = {"on_after_backward": True, "on_before_optimizer_step": True, "configure_gradient_clipping": False}


def hooks_read_parameters(module: nn.Module, callbacks: list[Callback]) -> list[str]:
    """Which of :data:`HOOKS` the module and callbacks override, as ``Class.hook`` (empty: none)."""
    from lightning.pytorch import LightningModule

    found = []
    for hook, callbacks_have_it in HOOKS.items():
        if isinstance(module, LightningModule) and is_overridden(hook, module, LightningModule):
            found.append(f"{type(module).__name__}.{hook}")
        found += [
            f"{type(c).__name__}.{hook}" for c in callbacks if callbacks_have_it and is_overridden(hook, c, Callback)
        ]
    return found


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

    def __init__(self, module: nn.Module, hooks: frozenset[str] = frozenset(HOOKS)) -> None:
        self.module = module
        self.hooks = hooks  # those of HOOKS that someone overrides: the others run on the shards, nothing gathered
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

    def reads(self, hook: str) -> bool:
        return hook in self.hooks

    def as_seen(self, params: list[Tensor]) -> list[Tensor]:
        """``params`` (an optimizer's: the shards) as the hooks see them while the view is open."""
        return [self._swapped[id(p)].whole if id(p) in self._swapped else p for p in params]

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


def whole_parameters_in_hooks(
    model: nn.Module, owners: tuple[nn.Module, list[Callback]] | None, device: torch.device, processes_per_node: int
) -> WholeParameters | None:
    """The whole view for ``hook_view='whole'`` when the module or a callback of ``owners`` (``None``: no view
    wanted) overrides the hook; ``ValueError`` on every rank when whole parameters and gradients would not fit."""
    readers = hooks_read_parameters(*owners) if owners is not None else []
    if not readers:
        return None
    needed = whole_bytes(model)
    if device.type == "cuda":
        free: int | None = torch.cuda.mem_get_info(device)[0]
    else:
        available = host_memory.available()
        free = None if available is None else available // processes_per_node
    if not all_ranks_agree(free is None or needed <= free // 2, device):
        raise ValueError(
            f"{', '.join(readers)}: FSDP2Strategy(hook_view='whole') shows these hooks whole parameters and"
            f" gradients, as DDP does: {format_bytes(needed)} on each rank, more than"
            f" half of the {format_bytes(free or 0)} free. Pass `hook_view='sharded'`: the hook then sees DTensor"
            " shards (`p.grad.full_tensor()` gathers one gradient; norms of DTensors are global)."
        )
    return WholeParameters(model, frozenset(reader.rsplit(".", 1)[1] for reader in readers))


def explain_sharded_view(exception: BaseException) -> str | None:
    """A note for an error of code that read a DTensor shard as a plain tensor under ``hook_view='sharded'``."""
    if "its data is not allocated yet" not in str(exception):
        return None
    return (
        "Under FSDP2Strategy(hook_view='sharded'), parameters and gradients are DTensor shards, and code written"
        " for plain tensors (Lightning's `grad_norm`, `torch.tensor([...])` of norms) cannot read them. Pass"
        " `hook_view='whole'` to see them whole in the hooks that read gradients, as under DDP, or read"
        " `p.grad.full_tensor()`."
    )
