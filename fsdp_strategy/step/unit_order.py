"""Every rank must run the same sharded units' forwards, in the same order: a check that fails loudly when not.

A unit all-gathers its parameters in forward and reduce-scatters their gradients in backward. Ranks pair
collectives by their position in each rank's sequence, not by the unit that called them: when a unit runs
on some ranks only (experts that are units of their own and get no tokens, a head that some batches skip),
its all-gather meets another unit's on the other ranks. gloo pairs them without a word when their sizes
agree (each rank then computes with a mix of two units' shards, and the gradients are wrong), and aborts
when they differ; NCCL hangs or mixes up data. Unlike a parameter without a gradient (:mod:`.unused`), a
collective that was never called cannot be made up for afterwards.

So a forward pre-hook on each unit (the root excluded: it runs at every step) folds the unit's index into
an order-sensitive digest of this rank's forwards. After each backward that reduced gradients the digest
travels, as its highest and lowest value over the ranks, in the all-reduce :mod:`.unused` does anyway
(:meth:`UnitOrder.check` does one of its own on torch < 2.13 and after each evaluation step). When they
differ, and only then, the ranks gather their records, and every rank raises :class:`UnitMismatchError`
naming the units and the fix, before an optimizer step applies the gradients.

Forwards that activation checkpointing recomputes inside backward run the pre-hooks again; they are left out
(between :meth:`UnitOrder.before_backward` and :meth:`UnitOrder.after_backward`), as they repeat forwards
already recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from fsdp_strategy._compat import sharded_units
from fsdp_strategy.sharding.mixed_precision import is_normalization
from fsdp_strategy.sharding.policy import class_name
from fsdp_strategy.step.hooks import StepHook

__all__ = ["UnitMismatchError", "UnitOrder", "UnitOrderHook", "describe_mismatch"]

_MODULUS = 2**61 - 1  # a prime; the digest and its negation fit in an int64
_BASE = 1_000_003
_KEPT = 4096  # forwards whose order is kept to name the units in an error; the digest covers all of them
_LISTED = 8  # units named in an error


class UnitMismatchError(RuntimeError):
    """Sharded units ran forward on some ranks only, or in a different order on different ranks."""


class UnitOrder:
    """Records which of ``model``'s sharded units run forward, in order, and checks that every rank agrees.

    Every rank of ``group`` calls :meth:`check` (or passes :meth:`fingerprint` through an all-reduce and then
    :meth:`verify`) at the same points; each check covers the forwards since the one before.

    Args:
        model: the root of ``fully_shard``-ed units.
        group: the ranks that must agree (a gloo group for a record read on the host); ``None`` is the default group.
    """

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
        self.model = model
        self.group = group
        names = {id(m): name for name, m in model.named_modules()}
        units = sharded_units(model)
        self.names = [", ".join(names[id(m)] for m in members) for members, _ in units]
        self.classes = [", ".join(class_name(m) for m in members) for members, _ in units]
        # Norm units and groups (fully_shard([a, b])) are the strategy's own, never a wrap_policy's.
        self._norms = [len(members) > 1 or is_normalization(members[0]) for members, _ in units]
        self._routers = [_router(model, names[id(members[0])]) if len(members) == 1 else None for members, _ in units]
        # A group gathers when the first of its modules runs and stays gathered until backward frees it:
        # one record per group between backward passes, whichever of its modules ran (a head that some
        # batches skip, inside the group of the embedding, moves nothing of its own).
        self._grouped = [len(members) > 1 for members, _ in units]
        self._in_backward = False
        self.reset()
        self._handles = [
            m.register_forward_pre_hook(self._recorder(i)) for i, (members, _) in enumerate(units) for m in members
        ]

    @classmethod
    def attach(cls, model: nn.Module, *, group: dist.ProcessGroup | None = None) -> UnitOrder | None:
        """A recorder for ``model``; ``None`` when the root is its only unit (it runs whenever a step runs)."""
        if not any(isinstance(m, FSDPModule) and m is not model for m in model.modules()):
            return None
        return cls(model, group=group)

    def _recorder(self, index: int) -> Callable[[nn.Module, tuple], None]:
        # Kept out of torch.compile'd blocks (compile_blocks): traced, the changing digest would recompile them.
        @torch.compiler.disable
        def record(module: nn.Module, args: tuple) -> None:
            if self._in_backward:
                return
            if self._grouped[index]:
                if index in self._groups_seen:
                    return
                self._groups_seen.add(index)
            self._digest = (self._digest * _BASE + index + 1) % _MODULUS
            self._counts[index] += 1
            if len(self._order) < _KEPT:
                self._order.append(index)

        return record

    def reset(self) -> None:
        """Starts a new record (and forgets a backward that an exception interrupted)."""
        self._digest = 0
        self._counts = [0] * len(self.names)
        self._order: list[int] = []
        self._groups_seen: set[int] = set()
        self._in_backward = False

    def before_backward(self) -> None:
        """Forwards from here to :meth:`after_backward` are activation checkpointing's recomputation."""
        self._in_backward = True

    def after_backward(self) -> None:
        self._in_backward = False
        self._groups_seen.clear()  # backward freed the groups: their next forward gathers again

    def fingerprint(self) -> list[int]:
        """This rank's digest and its negation: after an all-reduce with MAX, the highest and minus the lowest."""
        return [self._digest, -self._digest]

    def verify(self, reduced: Sequence[int], *, during: str = "training") -> None:
        """Raises :class:`UnitMismatchError` on every rank if the ranks' digests differed; starts a new record.

        ``reduced`` is :meth:`fingerprint` all-reduced with MAX; ``during`` is ``"training"`` (the forwards since
        the last gradient reduction) or the evaluation step that ran them (``"validation_step"``).
        """
        record = (self._counts, self._order)
        highest, lowest = int(reduced[0]), -int(reduced[1])
        self.reset()
        if highest == lowest:
            return
        per_rank: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(per_rank, record, group=self.group)
        raise UnitMismatchError(describe_mismatch(self, per_rank, during=during))

    def check(self, *, during: str) -> None:
        """Agrees with every rank on the units that ran since the last check (one small all-reduce)."""
        pair = torch.tensor(self.fingerprint(), dtype=torch.int64)
        dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=self.group)
        self.verify(pair.tolist(), during=during)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def describe_mismatch(order: UnitOrder, per_rank: Sequence[tuple[list[int], list[int]]], *, during: str) -> str:
    """The error text for the ranks' records ``(forwards per unit, unit indices in order)``, rank by rank."""
    counts = [c for c, _ in per_rank]
    uneven = [i for i in range(len(order.names)) if len({c[i] for c in counts}) > 1]
    lines = [f"  '{order.names[i]}' ({order.classes[i]}): {_by_rank([c[i] for c in counts])}" for i in uneven[:_LISTED]]
    if len(uneven) > _LISTED:
        lines.append(f"  and {len(uneven) - _LISTED} more")
    if uneven:
        what, culprits = "did not run on every rank the same number of times", uneven
    else:  # the same forwards in another order
        orders = [o for _, o in per_rank]
        at = next((k for k in range(min(map(len, orders))) if len({o[k] for o in orders}) > 1), None)
        culprits = [] if at is None else sorted({o[at] for o in orders})
        what = "ran in a different order on different ranks"
        if at is not None:
            ran = ", ".join(f"rank {r}: '{order.names[o[at]]}'" for r, o in enumerate(orders))
            lines.append(f"  unit forward number {at + 1}: {ran}")
        else:
            lines.append(f"  (the first {_KEPT} unit forwards, which are kept to name them, agree on every rank)")
    when = "since the last gradient reduction" if during == "training" else f"in this {during}"
    damage = (
        "the gradients of this step are wrong (no optimizer step was taken with them)"
        if during == "training"
        else f"the outputs of this {during} are wrong"
    )
    return (
        f"Sharded units {what} ({when}):\n" + "\n".join(lines) + "\n"
        "Each unit's forward all-gathers its parameters, and ranks pair collectives by the order in which they call"
        f" them, not by unit: another unit's all-gather stood in for a missing one, so {damage}. Every sharded unit"
        f" must run forward on every rank at every step, in the same order. {_fix(order, culprits)}"
    )


def _fix(order: UnitOrder, culprits: Sequence[int]) -> str:
    """The ``wrap_policy`` that makes units of what runs everywhere, and of the modules that route to the culprits."""
    bad = {order.classes[i] for i in culprits}
    if not bad:
        return "Fix: pass a wrap_policy whose units run on every rank at every step."
    kept = {c for c, norm in zip(order.classes, order._norms) if c not in bad and not norm}
    routers = {r for r in (order._routers[i] for i in culprits) if r is not None}
    policy = f"wrap_policy={sorted(kept | routers)!r}" if kept | routers else "wrap_policy=None"
    if routers:
        fix = f"Fix: wrap the module that routes to them as the unit, not each of them: {policy}."
    else:
        fix = f"Fix: leave them out of the units, so that they are gathered with the rest of the model outside the blocks, once per step on every rank: {policy}."
    return (
        f'{fix} (wrap_policy="auto" makes a unit of each child of an nn.ModuleList or nn.Sequential that holds'
        " two or more modules of one class; an explicit wrap_policy chooses instead.)"
    )


def _by_rank(counts: Sequence[int]) -> str:
    ranks: dict[int, list[int]] = {}
    for rank, count in enumerate(counts):
        ranks.setdefault(count, []).append(rank)
    parts = []
    for count, group in sorted(ranks.items(), reverse=True):
        where = f"rank {group[0]}" if len(group) == 1 else f"ranks {_spans(group)}"
        parts.append(f"not on {where}" if count == 0 else f"{_times(count)} on {where}")
    return ", ".join(parts)


def _times(count: int) -> str:
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def _spans(ranks: list[int]) -> str:
    if len(ranks) > 6:
        return f"{', '.join(map(str, ranks[:5]))}, ... ({len(ranks)} ranks)"
    return ", ".join(map(str, ranks))


def _router(model: nn.Module, name: str) -> str | None:
    """The class of the nearest module above ``name`` that is not a container: what calls the unit; ``None``
    when that is the root (a policy cannot select it)."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = model.get_submodule(".".join(parts[:end]))
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            return class_name(module)
    return None


class UnitOrderHook(StepHook):
    """:class:`UnitOrder` at each step: recording around backward, and after an evaluation step, which reduces
    nothing to carry the digest, one small all-reduce of its own before its outputs reach the metrics."""

    def __init__(self, order: UnitOrder) -> None:
        self.order = order

    def after_evaluation_step(self, during: str) -> None:
        self.order.check(during=during)

    def before_backward(self, loss: Tensor, *, manual: bool) -> None:
        self.order.before_backward()

    def after_backward(self, *, reduced: bool) -> None:
        self.order.after_backward()

    def close(self, *, wait: bool) -> None:
        self.order.close()
