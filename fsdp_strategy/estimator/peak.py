"""The per-rank peak of a training step, activations included, for one strategy and world size.

:func:`step_peak` replays a step recorded by :func:`fsdp_strategy.estimator.trace.trace_step` under one plan.
The plan's units say what FSDP2 adds at each moment: a unit's gathered parameters from its forward until it
reshards (``fsdp2``: right after its forward, again from its backward on, the next unit prefetched;
``fsdp2_grad_op``: until its backward ends; the root for the whole step), the gathering buffer while a unit is
gathered, the unit's unsharded gradients until its reduce-scatter, that reduce-scatter's input (held until the
next one) and the sharded gradients it leaves. The blocks' gathering buffers and reduce-scatter inputs stay
allocated between uses, in a pool (:mod:`fsdp_strategy.sharding.comm_pool`, on CPU; CUDA's caching allocator keeps them
as reserved memory that its live count leaves out, so there the prediction is higher by those buffers). DDP
holds full parameters, gradients and a gradient bucket of their size. The optimizer step adds Adam's per-parameter
temporaries. The largest total is the peak: the bytes of live tensors that :class:`~fsdp_strategy.ShardingMonitor`
measures (``live peak``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdp_strategy.estimator.groups import (
    UnitGroup,
    group_sizes,
    plan_groups,
    shard_numel,
)
from fsdp_strategy.estimator.model_state import Estimate
from fsdp_strategy.estimator.tensor_split import TensorSplits, all_reduced_activation_bytes, tensor_splits
from fsdp_strategy.estimator.trace import StepTrace, trace_step
from fsdp_strategy.sharding.policy import ModulePolicy, PolicyInput

__all__ = ["StepPeak", "StepPeaks", "step_peak"]


# Lightning's fit loop fetches the next batch before it runs the current one (to know whether it is the last).
_BATCHES_HELD = 2
# Adam(W)'s single-tensor step (torch's default for CPU tensors) holds up to three temporaries of the
# parameter it updates (measured on torch 2.13: sqrt, the division by the bias correction, the update).
_ADAM_TEMPORARIES = 3


@dataclass(frozen=True)
class StepPeak:
    """The largest bytes of live tensors one rank holds during a step, what activations made of them, and when."""

    bytes: int
    activation_bytes: int
    moment: str


class StepPeaks:
    """Step peaks of one model for any strategy, world size, micro-batch size and checkpointing choice.

    A trace does not depend on the world size, and all FSDP2 variants share one (their units are the same), so
    each ``(DDP or FSDP2, micro-batch size, checkpointing)`` is traced once, on a fresh model from ``build``
    (a meta-device LightningModule), and replayed for every estimate. ``make_batch(n)`` returns ``n`` samples.
    """

    def __init__(
        self,
        build: Callable[[], nn.Module],
        make_batch: Callable[[int], Any],
        *,
        precision: str,
        wrap_policy: PolicyInput = "auto",
        activation_checkpointing: ModulePolicy | None = None,
        tensor_parallel_plan: Mapping[str, str] | None = None,
    ) -> None:
        self.build = build
        # Under tensor parallelism: how the layers are split (else the model's base_model_tp_plan). The replay counts
        # each tensor-parallel rank's part of the units, and the trace sizes the split layers' activations.
        self.tensor_parallel_plan = tensor_parallel_plan
        self.make_batch = make_batch
        self.precision = precision
        self.wrap_policy = wrap_policy
        self.activation_checkpointing = activation_checkpointing
        self._traces: dict[tuple[bool, int, bool, int], tuple[StepTrace, list[UnitGroup], TensorSplits]] = {}

    def peak(
        self, estimate: Estimate, *, micro_batch_size: int, checkpointed: bool = False, accumulate: int = 1
    ) -> StepPeak:
        """The peak of ``estimate``'s strategy and world size at ``micro_batch_size`` samples per forward."""
        if checkpointed and self.activation_checkpointing is None:
            raise ValueError("`checkpointed=True` needs an activation_checkpointing policy.")
        trace, groups, _ = self._trace(estimate, micro_batch_size, checkpointed)
        return step_peak(trace, groups, estimate, accumulate=accumulate)

    def tensor_parallel_all_reduce(
        self, estimate: Estimate, *, micro_batch_size: int, accumulate: int = 1
    ) -> int | None:
        """Activation bytes ``estimate``'s tensor-parallel layers all-reduce per optimizer step (see
        :func:`~fsdp_strategy.estimator.tensor_split.all_reduced_activation_bytes`), from the traced step; ``None``
        when the split is not known."""
        trace, _, splits = self._trace(estimate, micro_batch_size, checkpointed=False)
        if not splits.styles:
            return None
        return accumulate * all_reduced_activation_bytes(trace.layer_activations, splits.styles)

    def _trace(
        self, estimate: Estimate, micro_batch_size: int, checkpointed: bool
    ) -> tuple[StepTrace, list[UnitGroup], TensorSplits]:
        sharded = estimate.strategy != "ddp"
        key = (sharded, micro_batch_size, checkpointed, estimate.tensor_parallel)
        if key not in self._traces:
            model = self.build()
            splits = tensor_splits(model, estimate.tensor_parallel, self.tensor_parallel_plan)
            groups = plan_groups(
                model,
                strategy=estimate.strategy,
                precision=self.precision,
                wrap_policy=self.wrap_policy,
                splits=splits,
            )
            policy = self.activation_checkpointing if checkpointed else None
            trace = trace_step(
                model,
                self.make_batch,
                batch_size=micro_batch_size,
                precision=self.precision,
                groups=groups,
                sharded=sharded,
                activation_checkpointing=policy,
                layers=list(splits.styles),
            )
            self._traces[key] = (trace, groups, splits)
        return self._traces[key]


# --- replaying a trace for one strategy ---------------------------------------------------------------------------


def step_peak(trace: StepTrace, groups: Sequence[UnitGroup], estimate: Estimate, *, accumulate: int = 1) -> StepPeak:
    """The per-rank peak of ``estimate``'s strategy and world size over a step traced with :func:`trace_step`
    (``groups``: the plan the estimate counted). With ``accumulate`` micro-batches per optimizer step, every
    micro-batch is one traced step; the first frees the previous step's gradients, the last reduces them."""
    roles = ["only"] if accumulate == 1 else ["first", *(["middle"] if accumulate > 2 else []), "last"]
    if estimate.strategy == "ddp":
        peaks = [_replay_ddp(trace, groups, estimate, role) for role in roles]
    else:
        # The blocks' collective buffers come from a pool (fsdp_strategy.sharding.comm_pool, on CPU) that keeps, from
        # the first step on, as many of each size as were ever in use at once: a first replay counts them.
        pool = _Pool()
        for role in roles:
            _replay_fsdp(trace, groups, estimate, role, pool)
        pool.filled = True
        peaks = [_replay_fsdp(trace, groups, estimate, role, pool) for role in roles]
    return max(peaks, key=lambda p: p.bytes)


class _Pool:
    """The pooled buffers in use, by size in bytes (an all-gather output and a reduce-scatter input of the same
    size and dtype share buffers), and the most of each size ever in use at once."""

    def __init__(self) -> None:
        self.most: dict[int, int] = {}
        self.filled = False  # then the buffers not in use count too: the pool keeps them

    def idle_bytes(self, in_use: list[int]) -> int:
        """Bytes the pool holds besides ``in_use`` (sizes of the buffers in use now), which it also records."""
        counts: dict[int, int] = {}
        for size in in_use:
            counts[size] = counts.get(size, 0) + 1
        for size, count in counts.items():
            self.most[size] = max(self.most.get(size, 0), count)
        if not self.filled:
            return 0
        return sum((most - counts.get(size, 0)) * size for size, most in self.most.items())


class _Peak:
    def __init__(self) -> None:
        self.best = StepPeak(0, 0, "")

    def see(self, total: int, activations: int, moment: str) -> None:
        if total > self.best.bytes:
            self.best = StepPeak(total, activations, moment)


def _optimizer_temporaries(groups: Sequence[UnitGroup], estimate: Estimate, shards: int) -> int:
    if estimate.optimizer not in ("adam", "adamw"):
        return 0
    largest = max(
        (shard_numel(p.rank_shape, shards) * p.storage for g in groups for p in g.params if p.trainable), default=0
    )
    return _ADAM_TEMPORARIES * largest


def _replay_ddp(trace: StepTrace, groups: Sequence[UnitGroup], estimate: Estimate, role: str) -> StepPeak:
    # Parameters, optimizer state, buffers and DDP's gradient buckets (gradients' size) stay for the whole fit;
    # the gradients exist from their first accumulation until zero_grad, just before the next backward.
    held = estimate.param_bytes + estimate.optimizer_bytes + estimate.grad_bytes
    held += trace.buffer_bytes + trace.batch_bytes * (_BATCHES_HELD - 1)
    grads = estimate.grad_bytes  # the previous step's, or this step's earlier micro-batches'
    peak, activations, phase = _Peak(), 0, "forward"
    for record in trace.records:
        if isinstance(record, int):
            activations = record
            peak.see(held + grads + activations, activations, phase)
        elif record[0] == "backward":
            phase = "backward"
            if role in ("only", "first"):
                grads = 0
        elif record[0] == "grad":
            if role in ("only", "first"):
                grads += record[2]
            else:  # accumulated in place: the new gradient lives only until it is added
                peak.see(held + grads + activations + record[2], activations, phase)
    if role in ("only", "last"):
        peak.see(held + estimate.grad_bytes + _optimizer_temporaries(groups, estimate, 1), 0, "optimizer step")
    return peak.best


def _replay_fsdp(trace: StepTrace, groups: Sequence[UnitGroup], estimate: Estimate, role: str, pool: _Pool) -> StepPeak:
    shards = estimate.mesh[1]
    sizes = {g.name if not g.is_root else "": group_sizes(g, shards) for g in groups}
    owner = {p.name: ("" if g.is_root else g.name) for g in groups for p in g.params}
    # The trace runs the unsplit model: a tensor-parallel rank's gradient is its part of the traced one.
    rank_part = {
        p.name: math.prod(p.rank_shape) / (math.prod(p.shape) or 1)
        for g in groups
        for p in g.params
        if p.split_dim is not None
    }
    reshard_after_forward = estimate.strategy != "fsdp2_grad_op"
    # Groups sharded with reshard_after_forward=False stay gathered from their forward until their backward.
    kept = {g.name for g in groups if not g.is_root and g.reshard_after_forward is False}
    # The blocks, whose all-gather outputs and reduce-scatter inputs are pooled (with one shard: no collectives).
    pooled = {
        g.name
        for g in groups
        if shards > 1
        and not g.is_root
        and g.reshard_after_forward is None
        and "," not in g.name
        and estimate.strategy != "fsdp2_offload"
    }
    reduce_input_unit = ""
    # A group's gradients are reduced once every member's backward is done (or when backward ends).
    members = {g.name: g.name.count(",") + 1 for g in groups if not g.is_root}
    backward_done: dict[str, int] = {}
    offload = estimate.strategy == "fsdp2_offload"
    reduce = role in ("only", "last")
    held = (
        estimate.param_bytes + estimate.optimizer_bytes + trace.buffer_bytes + trace.batch_bytes * (_BATCHES_HELD - 1)
    )
    # Before zero_grad: the previous step's sharded gradients (first micro-batch), or the unsharded ones
    # accumulated by this step's earlier micro-batches (reduce dtype, full size).
    sharded_grads = 0 if offload or role in ("middle", "last") else estimate.grad_bytes
    accumulated = {u: (s.reduced if role in ("middle", "last") else 0) for u, s in sizes.items()}
    gathered: dict[str, int] = {}  # unsharded parameters
    buffers: dict[str, int] = {}  # all-gather outputs not yet copied out, or kept by FSDP2 (see gather)
    unsharded: dict[str, int] = dict.fromkeys(sizes, 0)
    reduce_input = 0
    done: set[str] = set()
    peak, activations, phase = _Peak(), 0, "forward"
    order = [u for u in trace.units if u in sizes]

    def total(extra: int = 0) -> int:
        in_use = [size for unit, size in buffers.items() if unit in pooled]
        in_use += [reduce_input] if reduce_input and reduce_input_unit in pooled else []
        idle = pool.idle_bytes(in_use)
        return (
            held
            + sharded_grads
            + activations
            + sum(gathered.values())
            + sum(buffers.values())
            + sum(unsharded.values())
            + sum(accumulated.values())
            + reduce_input
            + idle
            + extra
        )

    def gather(unit: str) -> None:
        # The all-gather fills one flat buffer, copied out into the unit's parameters. In forward FSDP2 keeps
        # that buffer until the next unit's copy-out; in backward it lets it go at once, and gathers the
        # next unit ahead (prefetch), whose buffer waits until that unit's backward copies it out.
        if unit not in sizes or unit in gathered:
            return
        buffers.setdefault(unit, sizes[unit].gathered)
        gathered[unit] = sizes[unit].gathered
        peak.see(total(), activations, phase)
        if phase == "forward":
            for other in [u for u in buffers if u != unit]:
                del buffers[other]
        else:
            del buffers[unit]

    def prefetch(unit: str) -> None:
        if unit in sizes and unit not in gathered and unit not in buffers:
            buffers[unit] = sizes[unit].gathered
            peak.see(total(), activations, phase)

    def post_backward(unit: str) -> None:
        nonlocal reduce_input, reduce_input_unit, sharded_grads
        if unit in done or unit not in sizes:
            return
        done.add(unit)
        gathered.pop(unit, None)
        size = sizes[unit]
        if not reduce:
            if unsharded[unit] and size.reduced != size.gathered_grads:  # upcast to the reduce dtype
                peak.see(total(size.reduced), activations, phase)
            accumulated[unit] = size.reduced if (unsharded[unit] or accumulated[unit]) else 0
            unsharded[unit] = 0
            return
        # The previous unit's reduce-scatter input is let go first; this unit's is filled before its unsharded
        # gradients are freed.
        reduce_input, reduce_input_unit = size.reduced, unit
        peak.see(total(), activations, phase)
        unsharded[unit] = accumulated[unit] = 0
        sharded_grads += 0 if offload else size.sharded_trainable
        # gloo reduce-scatters a full copy of the input (measured on torch 2.13, CPU)
        peak.see(total(size.reduced), activations, phase)

    gather("")  # the root: gathered for the whole step
    for record in trace.records:
        if isinstance(record, int):
            activations = record
            peak.see(total(), activations, phase)
            continue
        kind = record[0]
        if kind == "fw":
            gather(record[1])
        elif kind == "fw_end" and reshard_after_forward and record[1] not in kept:
            gathered.pop(record[1], None)
        elif kind == "root_fw_end":
            buffers.clear()
        elif kind == "backward":
            phase = "backward"
            buffers.clear()
            if role in ("only", "first"):
                sharded_grads = 0  # zero_grad
        elif kind == "bw":
            unit = record[1]
            gather(unit)
            if unit in order and order.index(unit) > 0:
                prefetch(order[order.index(unit) - 1])
        elif kind == "grad":
            unit = owner.get(record[1], "")
            grad = round(record[2] * rank_part.get(record[1], 1.0))
            if accumulated[unit] and sizes[unit].reduced == sizes[unit].gathered_grads:
                peak.see(total(grad), activations, phase)  # added in place to the accumulated gradient
            else:
                unsharded[unit] += grad
        elif kind == "bw_end":
            backward_done[record[1]] = backward_done.get(record[1], 0) + 1
            if backward_done[record[1]] >= members.get(record[1], 1):
                post_backward(record[1])
    for unit in reversed(order):  # units whose inputs needed no gradient reduce at the end of backward
        post_backward(unit)
    post_backward("")
    if reduce:
        reduce_input, activations, phase = 0, 0, "optimizer step"
        peak.see(total(_optimizer_temporaries(groups, estimate, shards)), 0, phase)
    return peak.best
