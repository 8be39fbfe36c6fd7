"""Parameters that get no gradient on some ranks: mixture-of-experts routing, data-dependent branches.

FSDP2 reduce-scatters a unit's gradients in one collective built from the parameters that received a
gradient on this rank. When ranks used different parameters, they pass collectives of different sizes:
gloo aborts the process ("Received data size doesn't match expected size"), NCCL hangs or mixes up
data. ``FSDPModule.set_reduce_scatter_unused_params(True)`` (public since torch 2.13) makes every rank
contribute zeros for the parameters it did not use, so the collectives agree and a parameter used on
some ranks gets the average over all ranks, with zeros from the others: what DDP computes with
``find_unused_parameters=True``.

DDP leaves alone the gradient of a parameter that *no* rank used (``None`` after ``zero_grad()``), so
optimizers skip it: no weight decay, no momentum, no Adam step for it. Zeros would move it. So each
rank records which parameters received a gradient (a hook on FSDP2's unsharded parameters, which are
created at a unit's first all-gather and reused afterwards), and after each backward that reduced
gradients one small all-reduce of that record tells every rank which parameters no rank used; their
gradients are put back to what they were before. Like DDP, a parameter counts as used when it got a
gradient in any micro-batch since the last reduction.

When this rank used every parameter, nothing here can be unused on all ranks: it joins the all-reduce
without waiting for it, unless the record also carries the digest of the units' forwards
(:mod:`.unit_order`), which every rank must check before the optimizer step. The record travels over a
gloo group on the host, so no CUDA synchronization is added.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_strategy.unit_order import UnitOrder

__all__ = ["UnusedParameters", "explain", "supported"]

_MIXED_DTYPES = "FSDP reduce-scatter expects uniform gradient dtype"


def supported() -> bool:
    """Whether this torch can reduce-scatter zeros for unused parameters (torch >= 2.13)."""
    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


class UnusedParameters:
    """Keeps a sharded module's gradients as DDP's ``find_unused_parameters=True`` leaves them.

    Call :meth:`before_backward` before every backward and :meth:`after_backward` after each backward
    that reduced gradients (not after those of ``set_requires_gradient_sync(False)`` micro-batches).
    Every rank of ``group`` calls them at the same points.

    Args:
        model: the root of ``fully_shard``-ed units (parameters are DTensors).
        group: a gloo group over the data-parallel ranks for the record; ``None`` is the default group.
    """

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
        if not supported():
            raise RuntimeError(
                "Parameters unused on some ranks need torch >= 2.13 (FSDPModule.set_reduce_scatter_unused_params);"
                f" this is torch {torch.__version__}."
            )
        self.model = model
        self.group = group
        named = list(model.named_parameters())
        self._sharded = [p for _, p in named]
        self._used = [False] * len(named)
        self._none_before: list[bool] = []
        self._pending: dist.Work | None = None
        unsharded = _unsharded_parameters(model)
        missing = [name for name, _ in named if name not in unsharded]
        if missing:  # such a parameter would count as unused everywhere and lose its gradient
            raise RuntimeError(f"No unsharded parameter found for {missing}; are they managed by fully_shard?")
        self._handles = [
            unsharded[name].register_post_accumulate_grad_hook(self._marker(i)) for i, (name, _) in enumerate(named)
        ]
        model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]

    def _marker(self, index: int) -> Callable[[Tensor], None]:
        def mark(_: Tensor) -> None:
            self._used[index] = True

        return mark

    def before_backward(self) -> None:
        """Notes which gradients are ``None`` before a backward reduces into them."""
        self._none_before = [p.grad is None for p in self._sharded]

    def after_backward(self, *, order: UnitOrder | None = None) -> None:
        """Agrees with every rank on the parameters no rank used, and gives them their gradient back.

        With ``order``, its digest travels in the same all-reduce, and a mismatch raises
        :class:`~fsdp_strategy.unit_order.UnitMismatchError` on every rank (before any gradient is touched).
        """
        self.wait()
        local = [int(used or not p.requires_grad) for used, p in zip(self._used, self._sharded)]
        self._used = [False] * len(self._sharded)
        record = torch.tensor(local + (order.fingerprint() if order is not None else []), dtype=torch.int64)
        work = dist.all_reduce(record, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if all(local) and order is None:
            self._pending = work
            return
        work.wait()
        reduced = record.tolist()
        if order is not None:
            order.verify(reduced[len(local) :])
        none_before = self._none_before or [False] * len(self._sharded)
        for index, used in enumerate(reduced[: len(local)]):
            if not used and none_before[index]:
                self._sharded[index].grad = None

    def wait(self) -> None:
        """Waits for the record this rank sent without waiting (before the process group goes away)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def close(self) -> None:
        """Removes the hooks; the model reduce-scatters only the gradients it has again."""
        self.wait()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.model.set_reduce_scatter_unused_params(False)  # type: ignore[operator]


def _unsharded_parameters(model: nn.Module) -> dict[str, Tensor]:
    """FSDP2's unsharded parameter for each name, gathering one unit at a time.

    While a unit is unsharded, ``named_parameters()`` yields the unsharded tensors of the parameters it
    manages (created at its first all-gather and reused by every later one) and DTensors for the others.
    """
    found: dict[str, Tensor] = {}
    for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        unit.unshard()
        gathered = [(name, p) for name, p in model.named_parameters() if not isinstance(p, DTensor)]
        found.update((name, p) for name, p in gathered if name not in found)
        unit.reshard()
    return found


def explain(exception: BaseException) -> str | None:
    """What to do about a torch error that parameters without a gradient lead to; ``None`` for other errors."""
    if _MIXED_DTYPES not in str(exception):
        return None
    # Under *-mixed, FSDP2 keeps the gradients of earlier micro-batches in fp32; a unit whose parameters
    # got gradients in different micro-batches (or none) then holds fp32 and low-precision ones at once.
    return (
        "A sharded unit holds gradients of two dtypes: under a *-mixed precision with gradient accumulation,"
        " some of its parameters got a gradient in an earlier micro-batch and others only in the last one or"
        " in none (a data-dependent branch, an idle expert). Pass `sync_grads_each_micro_batch=True` to"
        " FSDP2Strategy to reduce every micro-batch's gradients, or train in precision='32-true'."
    )
