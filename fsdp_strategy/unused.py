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
without waiting for it. The record travels over a gloo group on the host, so no CUDA synchronization
is added.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["UnusedParameters", "supported"]


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
        self.names: list[str] = []
        self._sharded: list[Tensor] = []
        self._used: list[bool] = []
        self._none_before: list[bool] = []
        self._pending: dist.Work | None = None
        self._handles = []
        by_id = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
        for name, param in model.named_parameters():
            self.names.append(name)
            self._sharded.append(param)
        self._used = [False] * len(self.names)
        for index, unsharded in self._unsharded_parameters(model, by_id):
            self._handles.append(unsharded.register_post_accumulate_grad_hook(self._marker(index)))
        model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]

    @staticmethod
    def _unsharded_parameters(model: nn.Module, by_id: dict[int, int]) -> list[tuple[int, Tensor]]:
        """(index, unsharded parameter) for each parameter, gathering one unit at a time.

        While a unit is unsharded, ``named_parameters()`` yields FSDP2's unsharded tensors for the
        parameters it manages; the sharded DTensors stand for the others.
        """
        sharded = {name: p for name, p in model.named_parameters()}
        found: list[tuple[int, Tensor]] = []
        seen: set[str] = set()
        for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
            unit.unshard()
            for name, param in model.named_parameters():
                if name in sharded and name not in seen and not isinstance(param, DTensor):
                    seen.add(name)
                    found.append((by_id[id(sharded[name])], param))
            unit.reshard()
        return found

    def _marker(self, index: int) -> Callable[[Tensor], None]:
        def mark(_: Tensor) -> None:
            self._used[index] = True

        return mark

    def before_backward(self) -> None:
        """Notes which gradients are ``None`` before a backward reduces into them."""
        self._none_before = [p.grad is None for p in self._sharded]

    def after_backward(self) -> None:
        """Agrees with every rank on the parameters no rank used, and gives them their gradient back."""
        self.wait()
        local = [used or not p.requires_grad for used, p in zip(self._used, self._sharded)]
        self._used = [False] * len(self._sharded)
        record = torch.tensor(local, dtype=torch.uint8)
        work = dist.all_reduce(record, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if all(local):
            self._pending = work
            return
        work.wait()
        none_before = self._none_before or [False] * len(self._sharded)
        for index, used in enumerate(record.tolist()):
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
