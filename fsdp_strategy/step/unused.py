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
gradients are put back to what they were before. A gradient that reaches a shard directly (a penalty on the
weights computed outside forward) counts as used too. Like DDP, a parameter counts as used when it got a
gradient in any micro-batch since the last reduction.

When this rank used every parameter, nothing here can be unused on all ranks: it joins the all-reduce
without waiting for it, unless the record also carries the digest of the units' forwards
(:mod:`.unit_order`), which every rank must check before the optimizer step. The record travels over a
gloo group on the host, so no CUDA synchronization is added.

Frozen parameters (``requires_grad=False``: LoRA's base weights, a frozen backbone) get no gradient and take
no part. FSDP2 copies ``requires_grad`` from a sharded parameter to its unsharded one only when it gathers
the unit, so a parameter frozen or unfrozen while its unit is gathered (``toggle_optimizer`` in a manual
step) is brought up to date before each backward and before each forward of a unit's module.

With torch < 2.13 there are no zeros for unused parameters: ranks whose units' parameters differ in use send
reduce-scatters of different sizes (gloo aborts; :func:`explain` then names the torch release), and the record
makes every rank raise when the collectives happened to agree. The record also catches a gradient that reached
an unsharded parameter after its unit's gradients were reduced (torch < 2.13 reduces a root used by nested
forwards at the first of them): that gradient would be lost without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdp_strategy.sharding.unshard import gathered_parameters
from fsdp_strategy.step.hooks import StepHook
from fsdp_strategy.step.unit_order import UnitOrder

__all__ = ["UnusedHook", "UnusedParameters", "explain", "supported"]

_MIXED_DTYPES = "FSDP reduce-scatter expects uniform gradient dtype"
_SIZES_DIFFER = "Received data size doesn't match expected size"


def supported() -> bool:
    """Whether this torch can reduce-scatter zeros for unused parameters (torch >= 2.13)."""
    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


class UnusedParameters:
    """Keeps a sharded module's gradients as DDP's ``find_unused_parameters=True`` leaves them.

    Call :meth:`before_backward` before every backward and :meth:`after_backward` after each backward
    that reduced gradients into ``param.grad`` (not after those of ``set_requires_gradient_sync(False)``
    micro-batches, nor after those of ``set_requires_all_reduce(False)``, whose shards FSDP2 keeps aside until the
    all-reduce: a parameter used there only still counts as used at the window's end).
    Every rank of ``group`` calls them at the same points.

    Args:
        model: the root of ``fully_shard``-ed units (parameters are DTensors).
        group: a gloo group over the data-parallel ranks for the record; ``None`` is the default group.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        gathered: Sequence[tuple[Tensor, Tensor]] | None = None,
    ) -> None:
        self.model = model
        self.group = group
        self.zeros_for_unused = supported()
        named = list(model.named_parameters())
        self._names = [name for name, _ in named]
        self._sharded = [p for _, p in named]
        self._used = [False] * len(named)
        self._none_before: list[bool] = []
        self._pending: dist.Work | None = None
        # FSDP2's gathered parameter of each (the strategy finds them once, after sharding).
        unsharded = {id(s): g for s, g in (gathered_parameters(model) if gathered is None else gathered)}
        missing = [name for name, p in named if id(p) not in unsharded]
        if missing:  # such a parameter would count as unused everywhere and lose its gradient
            raise RuntimeError(f"No unsharded parameter found for {missing}; are they managed by fully_shard?")
        self._unsharded = [unsharded[id(p)] for p in self._sharded]
        self._handles = [_post_accumulate_hook(u, self._marker(i)) for i, u in enumerate(self._unsharded)]
        # A gradient can also reach the shard itself: a penalty on the weights computed in training_step from
        # `self.parameters()` (see step/whole_reads.py), which no unit's forward gathered for.
        # A gradient hook, not a post-accumulate one: FSDP2's own reduce writes every shard's `.grad` (zeros for
        # unused parameters), which must not count as use.
        self._handles += [_post_accumulate_hook(p, self._marker(i), on="gradient") for i, p in enumerate(self._sharded)]
        self._handles += [
            module.register_forward_pre_hook(self._mirror_hook(prefix))
            for prefix, module in model.named_modules()
            if isinstance(module, FSDPModule) and module is not model
        ]
        if self.zeros_for_unused:
            model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]

    def _marker(self, index: int) -> Callable[[Tensor], None]:
        def mark(_: Tensor) -> None:
            self._used[index] = True

        return mark

    def _mirror_hook(self, prefix: str) -> Callable[[nn.Module, tuple], None]:
        indices = [i for i, name in enumerate(self._names) if name.startswith(prefix + ".")]

        @torch.compiler.disable
        def mirror(_module: nn.Module, _args: tuple) -> None:
            self._mirror(indices)

        return mirror

    def _mirror(self, indices: Iterable[int]) -> None:
        for i in indices:
            wanted = self._sharded[i].requires_grad
            if self._unsharded[i].requires_grad != wanted:
                self._unsharded[i].requires_grad_(wanted)

    def before_backward(self) -> None:
        """Notes which gradients are ``None`` before a backward reduces into them; parameters frozen since their
        unit was gathered get no gradient from it, as under DDP."""
        self._mirror(range(len(self._sharded)))
        self._none_before = [p.grad is None for p in self._sharded]

    def after_backward(self, *, order: UnitOrder | None = None) -> None:
        """Agrees with every rank on the parameters no rank used, and gives them their gradient back.

        With ``order``, its digest travels in the same all-reduce, and a mismatch raises
        :class:`~fsdp_strategy.step.unit_order.UnitMismatchError` on every rank (before any gradient is touched).
        """
        self.wait()
        count = len(self._sharded)
        local = [int(used or not p.requires_grad) for used, p in zip(self._used, self._sharded)]
        self._used = [False] * count
        # Left on an unsharded parameter after the reduction: never reduced, about to be lost.
        stranded = [int(u.grad is not None) for u in self._unsharded]
        checks = [] if self.zeros_for_unused else [1 - used for used in local] + stranded
        record = torch.tensor(local + checks + (order.fingerprint() if order is not None else []), dtype=torch.int64)
        work = dist.all_reduce(record, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if all(local) and order is None and self.zeros_for_unused:
            self._pending = work
            return
        work.wait()
        reduced = record.tolist()
        used_anywhere, checked = reduced[:count], reduced[count : count + len(checks)]
        if order is not None:
            order.verify(reduced[count + len(checks) :])
        if checked:
            self._refuse_what_this_torch_cannot_reduce(used_anywhere, checked[:count], checked[count:])
        none_before = self._none_before or [False] * count
        for index, used in enumerate(used_anywhere):
            if not used and none_before[index]:
                self._sharded[index].grad = None

    def _refuse_what_this_torch_cannot_reduce(
        self, used_anywhere: list[int], unused_somewhere: list[int], stranded: list[int]
    ) -> None:
        some_ranks = [name for name, a, b in zip(self._names, used_anywhere, unused_somewhere) if a and b]
        if some_ranks:
            raise RuntimeError(
                f"Parameters got a gradient on some ranks only ({_listed(some_ranks)}): FSDP2 needs torch >= 2.13"
                f" (FSDPModule.set_reduce_scatter_unused_params) to reduce them as DDP's find_unused_parameters=True"
                f" does; this is torch {torch.__version__}. Upgrade torch, or make every rank use every parameter."
            )
        lost = [name for name, flag in zip(self._names, stranded) if flag]
        if lost:
            raise RuntimeError(
                f"The gradients of {_listed(lost)} arrived after their unit's gradients were reduced, and would be"
                f" lost: with torch {torch.__version__}, a gradient of a LightningModule's own parameter that flows"
                " into the input of `self(...)` (or another nested forward of the root) arrives too late. Upgrade"
                " torch to >= 2.13, or move the parameter into a submodule."
            )

    def wait(self) -> None:
        """Waits for the record this rank sent without waiting (before the process group goes away)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def close(self, *, wait: bool = True) -> None:
        """Removes the hooks; the model reduce-scatters only the gradients it has again.

        Call it whenever the tracker is done with, also after a failed stage (``wait=False``: a peer may never
        send its record): a hook on a gathered parameter and the tensor it sits on reference each other through
        torch's C++ side, a cycle the garbage collector cannot free, which would keep the whole model alive.
        """
        if wait:
            self.wait()
        self._pending = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.zeros_for_unused:
            self.model.set_reduce_scatter_unused_params(False)  # type: ignore[operator]


def _post_accumulate_hook(param: Tensor, hook: Callable[[Tensor], None], *, on: str = "accumulated") -> RemovableHandle:
    """``param.register_post_accumulate_grad_hook(hook)`` (``on="gradient"``: ``param.register_hook``, when autograd
    computes a gradient for it), also for a frozen parameter: the hook stays and runs once the parameter is
    unfrozen (torch refuses to register it on a tensor that does not require grad)."""
    register = param.register_post_accumulate_grad_hook if on == "accumulated" else param.register_hook
    if param.requires_grad:
        return register(hook)
    param.requires_grad_(True)
    try:
        return register(hook)
    finally:
        param.requires_grad_(False)


def _listed(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def explain(exception: BaseException) -> str | None:
    """What to do about a torch error that parameters without a gradient lead to; ``None`` for other errors."""
    if _SIZES_DIFFER in str(exception) and not supported():
        return (
            "Ranks reduce-scattered gradients of different sizes: some parameters got a gradient on some ranks only"
            " (a mixture of experts that skips idle experts, a data-dependent branch). FSDP2 needs torch >= 2.13"
            f" (FSDPModule.set_reduce_scatter_unused_params) to reduce them; this is torch {torch.__version__}."
        )
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


class UnusedHook(StepHook):
    """:class:`UnusedParameters` around each backward; ``order``'s digest travels in its record."""

    def __init__(self, unused: UnusedParameters, order: UnitOrder | None) -> None:
        self.unused = unused
        self.order = order

    def before_backward(self, loss: Tensor, *, manual: bool) -> None:
        self.unused.before_backward()

    def after_backward(self, *, reduced: bool) -> None:
        if reduced:
            self.unused.after_backward(order=self.order)

    def stage_ended(self) -> None:
        self.unused.wait()

    def close(self, *, wait: bool) -> None:
        # Its hooks would otherwise keep the module alive after its Trainer.
        self.unused.close(wait=wait)
