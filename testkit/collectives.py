"""Counting the collectives a process issues: which kind, how many bytes, over how many ranks.

:class:`CollectiveCounter` is a ``TorchDispatchMode``: every ``torch.distributed`` collective reaches torch's
dispatcher as a ``c10d`` op (gloo and NCCL alike), FSDP2's reduce-scatters and all-reduces included, and DTensor's
redistributions (tensor parallelism) as ``_c10d_functional`` ops, so it sees what was actually issued rather than what
a plan says; :func:`bytes_by_source` keeps the two apart. Bytes follow the estimator's convention
(:mod:`fsdp_strategy.estimator.model_state`): an all-gather counts its gathered output, a reduce-scatter its
unsharded input, an all-reduce and a broadcast their tensor. :class:`CountCollectives` keeps one counter
running over a Trainer's training and files each collective under the optimizer step it belongs to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Collective", "CollectiveCounter", "CountCollectives", "bytes_by_kind", "bytes_by_source", "counts_by_kind"]

# c10d op name -> (kind, index of the argument whose tensors count)
_OPS = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    # all_to_all_single: the input, what this rank sends (its own part included); the distributed Muon's.
    "alltoall_base_": ("all_to_all", 1),
}
# DTensor's redistributions (tensor parallelism) use the functional collectives, which name their group by a str;
# their input is the argument 0, and an all-gather's output is its input times the group size (argument 1).
_FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
}


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast, all_to_all
    nbytes: int
    group: str  # the process group's name (DeviceMesh.get_group(dim).group_name)
    floating: bool  # gradients and parameters, not the int64 records of bookkeeping
    source: str  # "c10d" (FSDP2, torch.distributed) or "functional" (DTensor's redistributions: tensor parallelism)
    step: int = 0  # the optimizer step it belongs to (CountCollectives)


class CollectiveCounter(TorchDispatchMode):
    """Records each collective (``c10d`` and functional) dispatched on this thread while active, in ``records``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []
        self.step = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        found = self._c10d(func, args) if func.namespace == "c10d" else None
        if func.namespace == "_c10d_functional":
            found = self._functional(func, args)
        if found is not None:
            kind, tensors, group, nbytes = found
            floating = all(t.is_floating_point() for t in tensors)
            source = "functional" if func.namespace == "_c10d_functional" else "c10d"
            self.records.append(Collective(kind, nbytes, group, floating, source, self.step))
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _c10d(func, args):  # type: ignore[no-untyped-def]
        known = _OPS.get(func._overloadpacket.__name__)
        if known is None:
            return None
        kind, index = known
        tensors = [t for t in tree_leaves(args[index]) if isinstance(t, torch.Tensor)]
        group = dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject)))
        return kind, tensors, group.group_name, sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def _functional(func, args):  # type: ignore[no-untyped-def]
        kind = _FUNCTIONAL_OPS.get(func._overloadpacket.__name__)
        if kind is None:
            return None
        tensors = [t for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors) * (args[1] if kind == "all_gather" else 1)
        return kind, tensors, args[-1], nbytes


def bytes_by_kind(records: Iterable[Collective]) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for record in records:
        totals[record.kind] += record.nbytes
    return dict(totals)


def counts_by_kind(records: Iterable[Collective]) -> dict[str, int]:
    return dict(Counter(record.kind for record in records))


def bytes_by_source(records: Iterable[Collective]) -> dict[str, int]:
    """``"source/kind"`` -> bytes: FSDP2's collectives (``c10d``) apart from tensor parallelism's (``functional``)."""
    totals: Counter[str] = Counter()
    for record in records:
        totals[f"{record.source}/{record.kind}"] += record.nbytes
    return dict(sorted(totals.items()))


class CountCollectives(L.Callback):
    """Counts the collectives of training from the first batch on; each is filed under the optimizer step
    (``trainer.global_step`` before it) in progress when it was issued."""

    def __init__(self) -> None:
        self.counter = CollectiveCounter()
        self._active = False

    @property
    def records(self) -> list[Collective]:
        return self.counter.records

    def per_step(self, kind: str, group: str, *, nbytes: bool = False) -> list[int]:
        """How many collectives of ``kind`` on floating-point tensors went over ``group`` in each optimizer step;
        with ``nbytes``, their bytes."""
        steps = [0] * (max((r.step for r in self.records), default=-1) + 1)
        for r in self.records:
            if r.kind == kind and r.group == group and r.floating:
                steps[r.step] += r.nbytes if nbytes else 1
        return steps

    def over_mesh(self, mesh: DeviceMesh | None) -> dict[str, list[int]]:
        """``"dim/kind"`` and ``"dim/kind/bytes"``: :meth:`per_step` of all-reduces and reduce-scatters over each
        dimension of ``mesh`` (this rank's groups); empty without a mesh (DDP). Groups are told apart by name: DTensor may run a later
        fit's tensor-parallel collectives over the groups of an earlier, equal mesh of the same process."""
        counts = {}
        for dim in (mesh.mesh_dim_names or ()) if mesh is not None else ():
            for kind in ("all_reduce", "reduce_scatter"):
                counts[f"{dim}/{kind}"] = self.per_step(kind, mesh.get_group(dim).group_name)
                counts[f"{dim}/{kind}/bytes"] = self.per_step(kind, mesh.get_group(dim).group_name, nbytes=True)
        return counts

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.counter.step = trainer.global_step
        if not self._active:
            self.counter.__enter__()
            self._active = True

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self._stop()

    def on_exception(self, trainer, pl_module, exception) -> None:  # type: ignore[no-untyped-def]
        self._stop()

    def _stop(self) -> None:
        if self._active:
            self.counter.__exit__(None, None, None)
            self._active = False
