"""Memory and communication per rank for each strategy, from the model's shapes alone.

:func:`estimate_module` counts, for one strategy and world size, what each rank keeps (parameters,
gradients, optimizer state) and what it moves per optimizer step (all-gather, reduce-scatter,
all-reduce). It plans the units with the strategy's own :func:`fsdp_strategy.sharding.parallelize.plan_units`,
so the root holds everything outside the blocks, tied weights are counted once, and under
``*-mixed`` the norms are fp32 units of their own. It reads only shapes and dtypes, so it works on
a meta-device model (nothing allocated) and on a model already sharded by FSDP2 (global shapes of
the DTensor parameters, its units as they were sharded).

:func:`fsdp_strategy.estimate` (:mod:`~fsdp_strategy.estimator.report`) runs it for every strategy and
world size on a model built on the meta device, and recommends one (``fsdp-strategy estimate``).

Figures are per rank, for the rank holding the largest shards (rank 0): FSDP2 pads each parameter's
first dimension to a multiple of the shard size, so rank 0 holds ``ceil(d0 / shards)`` rows.
Communication figures are full-size tensor bytes per optimizer step (an all-gather counts its
gathered output, a reduce-scatter its unsharded input); a ring moves ``(n - 1) / n`` of that per
rank for both, and twice that for an all-reduce (:attr:`Estimate.sent_bytes`). Nothing is counted
for a group of one rank, where FSDP2 copies instead of communicating.

Under tensor parallelism (``tensor_parallel_size`` above 1) the world is ``data_parallel x tensor_parallel``: a
parameter the tensor-parallel ranks split (:mod:`~fsdp_strategy.estimator.tensor_split`) holds ``1 / (dp x tp)`` of
its elements per rank, a replicated one ``1 / dp``; FSDP2 gathers and reduce-scatters each tensor-parallel rank's
part over the data-parallel ranks. The activations a Colwise -> Rowwise pair all-reduces over the tensor-parallel
ranks need a batch shape: they are counted from a traced step (:mod:`~fsdp_strategy.estimator.trace`), and are
``None`` (not estimated) otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from fsdp_strategy.estimator.groups import (
    GroupSizes,
    UnitGroup,
    canonical_precision,
    group_sizes,
    plan_groups,
)
from fsdp_strategy.estimator.tensor_split import tensor_splits, unmodelled_styles
from fsdp_strategy.option_checks import check_bool, check_positive_int
from fsdp_strategy.sharding.frozen import FROZEN_DTYPES, frozen_cast_dtype
from fsdp_strategy.sharding.mesh import data_parallel_world, resolve_mesh_shape
from fsdp_strategy.sharding.policy import PolicyInput

__all__ = [
    "OPTIMIZERS",
    "STRATEGIES",
    "Estimate",
    "check_optimizer",
    "estimate_module",
    "node_size_mismatch",
]

STRATEGIES = ("ddp", "fsdp2", "fsdp2_grad_op", "fsdp2_hybrid", "fsdp2_offload")
# Optimizer state tensors of the parameter's size, and whether a step counter is kept per parameter.
_OPTIMIZER_STATE = {
    "adamw": (2, True),
    "adam": (2, True),
    "sgd": (0, False),
    "sgd_momentum": (1, False),
    "none": (0, False),
}
OPTIMIZERS = tuple(_OPTIMIZER_STATE)
_STEP_COUNTER_BYTES = 4  # Adam's per-parameter fp32 "step" scalar
# The root is sharded with reshard_after_forward=False, yet its own parameters are gathered twice per
# micro-batch as trained (measured on torch 2.13): training_step runs as an FSDP forward, and the
# module's own forward nested inside it leaves the root's state idle, so the end of training_step frees
# the root and backward gathers it again. The plan keeps everything else out of the root for that reason.
_ROOT_GATHERS_PER_MICRO_BATCH = 2


@dataclass(frozen=True)
class Estimate:
    """One strategy at one world size. Bytes per rank (on the device unless named otherwise)."""

    strategy: str
    world_size: int
    mesh: tuple[int, int]  # (replicate, shard) of the data-parallel ranks
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    largest_unit_bytes: int  # the largest unit's full (gathered) parameters in compute dtype, root included
    all_gather_bytes: int  # per optimizer step: full-size bytes gathered by one rank
    reduce_scatter_bytes: int  # per optimizer step: full-size gradient bytes reduce-scattered
    all_reduce_bytes: int  # per optimizer step: DDP's gradients, or hybrid's gradient shard across replicas
    host_bytes: int  # sharded state kept in host memory (fsdp2_offload), 0 otherwise
    # Held only during the step: gathered units and unsharded gradients (FSDP2), gradient buckets and
    # autocast's low-precision weight copies (DDP). Activations are not included.
    working_bytes: int = 0
    precision: str = "32-true"
    optimizer: str = "adamw"
    note: str = ""
    # With a sample batch (fsdp_strategy.estimator.peak): the peak of live tensors over a traced step of
    # `batch_size` samples per forward, activations included, and with activation checkpointing.
    batch_size: int | None = None
    step_peak_bytes: int | None = None
    activation_bytes: int | None = None  # activations and temporaries at the moment of that peak
    checkpointed_peak_bytes: int | None = None
    tensor_parallel: int = 1  # ranks that split each layer; world_size = replicate x shard x tensor_parallel
    # per optimizer step: full-size activation bytes all-reduced over the tensor-parallel ranks (forward and
    # backward of each Colwise -> Rowwise pair); None where no batch was traced to size them
    tensor_parallel_all_reduce_bytes: int | None = 0

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state on the device."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        """The traced step's peak when a batch was given; else model state plus what the step holds besides
        it, activations not included."""
        if self.step_peak_bytes is not None:
            return self.step_peak_bytes
        return self.model_state_bytes + self.working_bytes

    @property
    def sent_bytes(self) -> int:
        """Bytes one rank sends per optimizer step over ring collectives (as many are received)."""
        replicate, shard = self.mesh
        gather_and_scatter = (self.all_gather_bytes + self.reduce_scatter_bytes) * (shard - 1) / shard
        reduce = 2 * self.all_reduce_bytes * (replicate - 1) / replicate
        tensor = self.tensor_parallel
        activations = 2 * (self.tensor_parallel_all_reduce_bytes or 0) * (tensor - 1) / tensor
        return round(gather_and_scatter + reduce + activations)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "mesh": list(self.mesh),  # tensor_parallel is its own field
            "model_state_bytes": self.model_state_bytes,
            "peak_bytes": self.peak_bytes,
            "sent_bytes": self.sent_bytes,
        }


# --- one module, one strategy --------------------------------------------------------------------


def estimate_module(
    module: nn.Module,
    *,
    strategy: str,
    world_size: int,
    precision: str = "32-true",
    optimizer: str = "adamw",
    processes_per_node: int | None = None,
    wrap_policy: PolicyInput = "auto",
    accumulate_grad_batches: int = 1,
    frozen_dtype: str | None = None,
    sync_grads_each_micro_batch: bool = False,
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: Mapping[str, str] | None = None,
) -> Estimate:
    """Memory per rank and communication per optimizer step of training ``module`` with ``strategy``.

    ``tensor_parallel_size`` (the strategy's option) splits ``world_size`` into data-parallel x tensor-parallel
    ranks. Which parameters are split is read from ``module``'s DTensor placements when it is split already, else
    from ``tensor_parallel_plan`` (Transformers' style strings by module name, ``*`` wildcards) or its Hugging Face
    ``base_model_tp_plan``; with none of them the estimate counts every parameter as replicated and says so in
    :attr:`Estimate.note`.

    Frozen parameters (``requires_grad=False``) count their storage only: no gradient, no optimizer state, nothing
    reduced. ``frozen_dtype`` (``"bfloat16"`` or ``"float16"``, the strategy's option of that name) is the dtype
    they are kept in; ``None``: as built.

    ``sync_grads_each_micro_batch`` (the strategy's option) reduce-scatters every micro-batch instead of keeping
    unsharded gradients: ``accumulate_grad_batches`` times the reduce-scatter bytes; hybrid's all-reduce stays once
    per step, and its partial sums (a gradient shard in reduce dtype per unit) are held between micro-batches.

    ``module`` may live on the meta device, or be sharded already by FSDP2 (its units are then the
    ones it was sharded with, and ``wrap_policy`` is not used). ``processes_per_node`` sets
    ``fsdp2_hybrid``'s shard size; by default two nodes of ``world_size / 2`` processes are assumed
    when the data-parallel ranks (``world_size / tensor_parallel_size``) are even (one node otherwise).

    Raises:
        ValueError / TypeError: an option that is not one of the accepted values.
    """
    precision = _check_options(
        module, strategy, world_size, precision, optimizer, processes_per_node, accumulate_grad_batches
    )
    check_bool("sync_grads_each_micro_batch", sync_grads_each_micro_batch)
    frozen = _frozen_storage(frozen_dtype)
    tensor = _check_tensor_parallel(strategy, world_size, tensor_parallel_size, processes_per_node)
    mesh, note = _mesh_for(strategy, world_size, processes_per_node, tensor)
    splits = tensor_splits(module, tensor, tensor_parallel_plan)
    groups = plan_groups(
        module, strategy=strategy, precision=precision, wrap_policy=wrap_policy, frozen_dtype=frozen, splits=splits
    )
    unmodelled = unmodelled_styles(splits.styles)
    notes = [note, splits.note, f"collectives of {', '.join(unmodelled)} layers not estimated" if unmodelled else ""]
    estimate = _estimate_groups(
        groups,
        strategy,
        world_size,
        mesh,
        precision,
        optimizer,
        _Accumulation(accumulate_grad_batches, sharded=sync_grads_each_micro_batch),
        "; ".join(filter(None, notes)),
    )
    if tensor == 1:
        return estimate
    return replace(estimate, tensor_parallel=tensor, tensor_parallel_all_reduce_bytes=None)


def _check_tensor_parallel(
    strategy: str, world_size: int, tensor_parallel_size: int, processes_per_node: int | None
) -> int:
    check_positive_int("tensor_parallel_size", tensor_parallel_size)
    if tensor_parallel_size > 1 and strategy == "ddp":
        raise ValueError(
            f"`tensor_parallel_size={tensor_parallel_size}` needs an fsdp2 strategy (FSDP2Strategy splits layers over"
            f" a tensor_parallel mesh dimension); got strategy='ddp'. Use tensor_parallel_size=1 with ddp."
        )
    data_parallel_world(world_size, tensor_parallel_size, processes_per_node)  # raises when it does not divide
    return tensor_parallel_size


def _check_options(
    module: nn.Module,
    strategy: str,
    world_size: int,
    precision: str,
    optimizer: str,
    processes_per_node: int | None,
    accumulate_grad_batches: int,
) -> str:
    """Validates the options and returns the precision in its canonical spelling."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module; got {type(module).__name__}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {', '.join(STRATEGIES)}; got {strategy!r}.")
    check_positive_int("world_size", world_size)
    check_positive_int("accumulate_grad_batches", accumulate_grad_batches)
    if processes_per_node is not None:
        check_positive_int("processes_per_node", processes_per_node)
    check_optimizer(optimizer)
    return canonical_precision(precision)


def _frozen_storage(frozen_dtype: str | None) -> torch.dtype | None:
    accepted = tuple(name for name in FROZEN_DTYPES if frozen_cast_dtype(name) is not None)
    if frozen_dtype is not None and frozen_cast_dtype(frozen_dtype) is None:
        # NF4's bytes per element are not a whole number; the estimate counts dtypes by their item size.
        raise ValueError(f"`frozen_dtype` must be one of {accepted} or None to be estimated; got {frozen_dtype!r}.")
    return frozen_cast_dtype(frozen_dtype)


def check_optimizer(optimizer: str) -> None:
    """Raises ``ValueError`` unless ``optimizer`` is one of :data:`OPTIMIZERS`."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}.")


def _mesh_for(
    strategy: str, world_size: int, processes_per_node: int | None, tensor: int = 1
) -> tuple[tuple[int, int], str]:
    """``(replicate, shard)`` of the data-parallel ranks (the world over ``tensor`` tensor-parallel ranks) and a
    note on how it was chosen."""
    ranks = world_size // tensor
    if strategy == "ddp":
        return (ranks, 1), ""
    if strategy == "fsdp2_offload":
        return (1, ranks), "CUDA only; the sharded state lives in host memory"
    if strategy != "fsdp2_hybrid":
        return (1, ranks), ""
    if processes_per_node is not None:
        if world_size % processes_per_node:
            raise ValueError(node_size_mismatch(processes_per_node, world_size))
        per_node = processes_per_node // tensor
        return resolve_mesh_shape(ranks, replicate_size=None, shard_size=None, processes_per_node=per_node), ""
    if ranks % 2 == 0:
        per_node = world_size // 2
        processes = f"{per_node} process{'es' if per_node > 1 else ''}"
        return (2, ranks // 2), f"assumes 2 nodes of {processes} (set processes_per_node)"
    odd = f"world size {world_size} is odd" if tensor == 1 else f"{ranks} data-parallel rank{'s' if ranks > 1 else ''}"
    return (1, ranks), f"one node assumed ({odd}): same as fsdp2"


def node_size_mismatch(processes_per_node: int, world_size: int) -> str:
    """Why ``fsdp2_hybrid`` cannot run ``world_size`` ranks in nodes of ``processes_per_node``."""
    return (
        f"`processes_per_node={processes_per_node}` must divide the world size {world_size}: fsdp2_hybrid"
        " shards within a node and replicates across nodes."
    )


def _optimizer_bytes(grad_bytes: int, step_counters: int, optimizer: str) -> int:
    tensors, counter = _OPTIMIZER_STATE[optimizer]
    return tensors * grad_bytes + (step_counters * _STEP_COUNTER_BYTES if counter else 0)


@dataclass(frozen=True)
class _Accumulation:
    micro_batches: int  # per optimizer step
    sharded: bool  # sync_grads_each_micro_batch: a reduce-scatter per micro-batch, sharded accumulation

    @property
    def unsharded(self) -> bool:
        """Whether full-size gradients are kept between micro-batches."""
        return self.micro_batches > 1 and not self.sharded

    @property
    def reduce_scatters(self) -> int:
        return self.micro_batches if self.sharded else 1


def _estimate_groups(
    groups: list[UnitGroup],
    strategy: str,
    world_size: int,
    mesh: tuple[int, int],
    precision: str,
    optimizer: str,
    accumulation: _Accumulation,
    note: str,
) -> Estimate:
    accumulate = accumulation.micro_batches
    replicate, shards = mesh
    sizes = [group_sizes(group, shards) for group in groups]
    params = sum(s.sharded for s in sizes)
    grads = sum(s.sharded_trainable for s in sizes)
    optimizer_state = _optimizer_bytes(grads, sum(s.step_counters for s in sizes), optimizer)
    common = {
        "strategy": strategy,
        "world_size": world_size,
        "mesh": mesh,
        "largest_unit_bytes": max(s.gathered for s in sizes),
        "precision": precision,
        "optimizer": optimizer,
        "note": note,
    }
    if strategy == "ddp":
        return Estimate(
            param_bytes=params,
            grad_bytes=grads,
            optimizer_bytes=optimizer_state,
            all_gather_bytes=0,
            reduce_scatter_bytes=0,
            all_reduce_bytes=grads if world_size > 1 else 0,  # one all-reduce per step: no_sync while accumulating
            host_bytes=0,
            working_bytes=_ddp_working_bytes(groups[0], grads),
            **{**common, "largest_unit_bytes": 0},  # nothing is gathered
        )
    offload = strategy == "fsdp2_offload"
    device_state = {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": optimizer_state}
    return Estimate(
        **({key: 0 for key in device_state} if offload else device_state),
        host_bytes=sum(device_state.values()) if offload else 0,
        all_gather_bytes=_all_gather_bytes(sizes, groups, strategy, accumulate) if shards > 1 else 0,
        reduce_scatter_bytes=accumulation.reduce_scatters * sum(s.reduced for s in sizes) if shards > 1 else 0,
        # once per step under sharded accumulation too: FSDP2 adds up the shards and all-reduces the sum
        all_reduce_bytes=sum(s.sharded_trainable_reduce for s in sizes) if replicate > 1 else 0,
        working_bytes=_fsdp_working_bytes(sizes, groups, strategy, accumulation, replicated=replicate > 1),
        **common,
    )


def _all_gather_bytes(sizes: list[GroupSizes], groups: list[UnitGroup], strategy: str, accumulate: int) -> int:
    # Blocks are gathered in forward and, when resharded after it, again in backward; groups kept
    # gathered from forward to backward once; the root see _ROOT_GATHERS_PER_MICRO_BATCH. Every
    # micro-batch gathers anew.
    def gathers(group: UnitGroup) -> int:
        if group.is_root:
            return _ROOT_GATHERS_PER_MICRO_BATCH
        if group.reshard_after_forward is False or strategy == "fsdp2_grad_op":
            return 1
        return 2

    return accumulate * sum(s.gathered * gathers(g) for s, g in zip(sizes, groups))


def _fsdp_working_bytes(
    sizes: list[GroupSizes], groups: list[UnitGroup], strategy: str, accumulation: _Accumulation, *, replicated: bool
) -> int:
    """The worst moment of backward: the units kept gathered from forward to backward (the root and
    the groups not resharded after forward) with their unsharded gradients, the block being computed
    (and, without ``grad_op``, the next one prefetched), its unsharded gradient and its reduce-scatter
    input. ``fsdp2_grad_op`` keeps every unit gathered from forward until its backward. Accumulating
    micro-batches keeps every unsharded gradient; with sharded accumulation under hybrid sharding, each unit's
    partial sum of reduce-scattered shards instead (1-D sharding accumulates in the gradients counted already)."""
    kept = [s for s, g in zip(sizes, groups) if g.is_root or g.reshard_after_forward is False]
    blocks = [s for s, g in zip(sizes, groups) if not (g.is_root or g.reshard_after_forward is False)]
    reduce_step = max([*(k.reduced for k in kept), *(b.gathered_grads + b.reduced for b in blocks)])
    if strategy == "fsdp2_grad_op":
        gathered = sum(s.gathered for s in sizes)
    else:
        gathered = sum(k.gathered for k in kept) + 2 * max([0, *(b.gathered for b in blocks)])
    if accumulation.unsharded:
        accumulated = sum(s.reduced for s in sizes)
    elif accumulation.micro_batches > 1 and replicated:
        accumulated = sum(s.sharded_trainable_reduce for s in sizes)
    else:
        accumulated = 0
    return gathered + sum(k.gathered_grads for k in kept) + reduce_step + accumulated


def _ddp_working_bytes(group: UnitGroup, grads: int) -> int:
    # DistributedDataParallel copies gradients into buckets of its own (Lightning keeps torch's
    # default gradient_as_bucket_view=False), and autocast keeps a low-precision copy of each
    # weight matrix for backward.
    matrices = [p for p in group.params if len(p.shape) >= 2 and p.compute < p.storage]
    autocast_copies = sum(math.prod(p.shape) * p.compute for p in matrices)
    return grads + autocast_copies
