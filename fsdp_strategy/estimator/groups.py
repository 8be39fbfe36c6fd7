"""What the strategy would shard, read from a module's shapes: its units (root first) and each parameter's bytes.

:func:`plan_groups` follows the strategy's own plan (:func:`fsdp_strategy.sharding.parallelize.plan_units`, or the
units of a module FSDP2 already sharded) and records, per parameter, its shape and the bytes per element it is kept,
gathered and reduced in under a precision. :func:`group_sizes` totals a group's bytes at one shard size, as FSDP2
pads and splits dim 0. :mod:`~fsdp_strategy.estimator.model_state` counts model state and communication from them;
:mod:`~fsdp_strategy.estimator.trace` and :mod:`~fsdp_strategy.estimator.peak` replay a step over them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from fsdp_strategy._compat import sharded_units
from fsdp_strategy.estimator.tensor_split import TensorSplits
from fsdp_strategy.plugins.precision import SUPPORTED_PRECISIONS
from fsdp_strategy.sharding.mixed_precision import (
    FULL_PRECISION_POLICY,
    is_normalization,
    mixed_precision_policy,
)
from fsdp_strategy.sharding.parallelize import plan_units
from fsdp_strategy.sharding.policy import PolicyInput, normalize_policy

__all__ = [
    "ACCEPTED_PRECISIONS",
    "GroupSizes",
    "ParamInfo",
    "UnitGroup",
    "canonical_precision",
    "group_sizes",
    "plan_groups",
    "shard_numel",
    "unique_parameters",
]

# The short spellings Lightning still accepts for Trainer(precision=...).
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
# What `precision` accepts: the supported precisions, then the aliases (the CLI's choices).
ACCEPTED_PRECISIONS = (*SUPPORTED_PRECISIONS, *_PRECISION_ALIASES)
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def canonical_precision(precision: str) -> str:
    """``precision`` as one of :data:`SUPPORTED_PRECISIONS` (Lightning's short aliases accepted)."""
    canonical = _PRECISION_ALIASES.get(str(precision), str(precision))
    if canonical not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {', '.join(SUPPORTED_PRECISIONS)} (or Lightning's aliases"
            f" {', '.join(_PRECISION_ALIASES)}); got {precision!r}."
        )
    return canonical


@dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    storage: int  # bytes per element of the kept (master) parameter, its gradient and optimizer state
    compute: int  # bytes per element when gathered
    reduce: int  # bytes per element when reduced
    trainable: bool
    name: str = ""  # qualified name in the module (a tied parameter's first name)
    split_dim: int | None = None  # the dimension tensor parallelism divides (None: replicated over it)
    split_ways: int = 1  # tensor-parallel ranks it is divided over

    @property
    def rank_shape(self) -> tuple[int, ...]:
        """The shape one tensor-parallel rank holds (the first, largest chunk), which FSDP2 then shards."""
        if self.split_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split_dim] = math.ceil(shape[self.split_dim] / self.split_ways)
        return tuple(shape)


@dataclass(frozen=True)
class UnitGroup:
    """The parameters of one FSDP unit (or the whole model under DDP)."""

    params: list[ParamInfo]
    is_root: bool = False
    # None: gathered again in backward unless the strategy keeps units gathered (fsdp2_grad_op);
    # False: gathered once per micro-batch (the norm group and the rest of the model).
    reshard_after_forward: bool | None = None
    name: str = ""  # the unit's modules, qualified and comma-joined ("" for the root and for DDP's single group)


def plan_groups(
    module: nn.Module,
    *,
    strategy: str,
    precision: str,
    wrap_policy: PolicyInput = "auto",
    frozen_dtype: torch.dtype | None = None,
    splits: TensorSplits | None = None,
) -> list[UnitGroup]:
    """The parameter groups :func:`estimate_module` counts: each FSDP unit, root first (DDP: one group).

    ``frozen_dtype``: the dtype the frozen floating-point parameters are kept in (the strategy's ``frozen_dtype``
    option, or a cast the user makes before DDP); ``None``: as built. ``splits``: the parameters tensor parallelism
    divides (:func:`~fsdp_strategy.estimator.tensor_split.tensor_splits`); ``None``: none.
    """
    precision = canonical_precision(precision)
    infos = partial(_param_infos, precision=precision, names=_names(module), frozen_dtype=frozen_dtype, splits=splits)
    if strategy == "ddp":
        return [UnitGroup(infos(unique_parameters(module), policy=mixed_precision_policy(precision)))]
    return _unit_groups(module, precision, wrap_policy, infos)


def _names(module: nn.Module) -> dict[int, str]:
    return {id(param): name for name, param in module.named_parameters()}


def _unit_groups(
    module: nn.Module, precision: str, wrap_policy: PolicyInput, infos: Callable[..., list[ParamInfo]]
) -> list[UnitGroup]:
    """The units FSDP2Strategy shards ``module`` into (root first), each with its own parameters."""
    # Policies are None or a MixedPrecisionPolicy whose None dtypes mean "as stored".
    low = mixed_precision_policy(precision)
    units: list[tuple[list[nn.Module], MixedPrecisionPolicy | None, bool | None]]
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        # Already sharded: its units are the modules fully_shard was applied to, grouped as sharded.
        units = []
        for members, reshard_after_forward in sharded_units(module):
            norms = low is not None and all(is_normalization(m) for m in members)
            units.append((members, FULL_PRECISION_POLICY if norms else low, reshard_after_forward))
    else:
        policy = normalize_policy(wrap_policy, option="wrap_policy")
        planned = plan_units(module, policy, mp_policy=low or MixedPrecisionPolicy(), keep_norms_fp32=low is not None)
        units = [(list(u.modules), u.mp_policy, u.reshard_after_forward) for u in planned]
    owners = _assign_parameters(module, [[id(m) for m in members] for members, _, _ in units])
    modules = {id(m): name for name, m in module.named_modules()}
    root = UnitGroup(infos(owners.pop(-1), policy=low), is_root=True)
    return [
        root,
        *(
            UnitGroup(
                infos(owners[i], policy=policy),
                name=",".join(modules[id(m)] for m in members),
                reshard_after_forward=reshard,
            )
            for i, (members, policy, reshard) in enumerate(units)
        ),
    ]


def _assign_parameters(module: nn.Module, units: list[list[int]]) -> dict[int, list[nn.Parameter]]:
    """Each parameter under the innermost unit that contains it (key -1, the root, when none does), once;
    ``units`` lists each unit's module ids."""
    unit_of = {key: index for index, members in enumerate(units) for key in members}
    owners: dict[int, list[nn.Parameter]] = {-1: [], **{index: [] for index in range(len(units))}}
    seen: set[int] = set()
    stack = [(module, -1)]
    while stack:
        current, owner = stack.pop()
        owner = unit_of.get(id(current), owner) if current is not module else -1
        for param in current.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                owners[owner].append(param)
        stack.extend((child, owner) for child in current.children())
    return owners


def unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters, a tied one once."""
    return list({id(p): p for p in module.parameters()}.values())


def _param_infos(
    params: Sequence[nn.Parameter],
    *,
    precision: str,
    policy: MixedPrecisionPolicy | None,
    names: dict[int, str],
    frozen_dtype: torch.dtype | None,
    splits: TensorSplits | None,
) -> list[ParamInfo]:
    infos = []
    true_dtype = _TRUE_DTYPES.get(precision)
    for param in params:
        floating = param.is_floating_point()
        storage = true_dtype if true_dtype is not None and floating else param.dtype  # *-true casts the whole model
        if frozen_dtype is not None and floating and not param.requires_grad:
            storage = frozen_dtype  # cast after the precision's conversion, before sharding
        compute = policy.param_dtype if policy is not None and policy.param_dtype and floating else storage
        reduce = policy.reduce_dtype if policy is not None and policy.reduce_dtype and floating else compute
        infos.append(
            ParamInfo(
                shape=tuple(param.shape),  # a DTensor's shape is the global one
                storage=storage.itemsize,
                compute=compute.itemsize,
                reduce=reduce.itemsize,
                trainable=param.requires_grad,
                name=names.get(id(param), ""),
                split_dim=None if splits is None else splits.dims.get(id(param)),
                split_ways=1 if splits is None else splits.size,
            )
        )
    return infos


def shard_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of rank 0's shard: FSDP2 splits dim 0 into ``shards`` chunks, the first one largest. Under tensor
    parallelism ``shape`` is a tensor-parallel rank's (:attr:`ParamInfo.rank_shape`)."""
    rows = shape[0] if shape else 1
    return math.ceil(rows / shards) * (math.prod(shape[1:]) if shape else 1)


@dataclass(frozen=True)
class GroupSizes:
    """Byte totals of one group at one shard size."""

    sharded: int  # rank 0's shards of all parameters, storage dtype
    sharded_trainable: int  # of the trainable ones (gradients)
    sharded_trainable_reduce: int  # the gradient shard in reduce dtype (hybrid's all-reduce)
    gathered: int  # full padded parameters in compute dtype (a tensor-parallel rank's part of them)
    gathered_grads: int  # full padded gradients in compute dtype (unsharded, before reduction)
    reduced: int  # full padded gradients in reduce dtype (reduce-scatter input)
    step_counters: int  # trainable parameter tensors (one optimizer step counter each)


def group_sizes(group: UnitGroup, shards: int) -> GroupSizes:
    sharded = sharded_trainable = sharded_reduce = gathered = gathered_grads = reduced = counters = 0
    for p in group.params:
        numel = shard_numel(p.rank_shape, shards)
        sharded += numel * p.storage
        gathered += numel * shards * p.compute
        if p.trainable:
            sharded_trainable += numel * p.storage
            sharded_reduce += numel * p.reduce
            gathered_grads += numel * shards * p.compute
            reduced += numel * shards * p.reduce
            counters += 1
    return GroupSizes(sharded, sharded_trainable, sharded_reduce, gathered, gathered_grads, reduced, counters)
