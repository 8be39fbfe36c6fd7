"""Small verbs that turn a plain module into a sharded one: plan units, checkpoint, compile, shard.

Each takes only what it needs and works without Lightning; ``FSDP2Strategy.setup`` calls them in order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from fsdp_strategy.policy import ModulePolicy, class_name, select_modules
from fsdp_strategy.precision import FULL_PRECISION_POLICY, is_normalization

__all__ = [
    "STEP_METHODS",
    "ShardedUnit",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fully_shard",
    "load_full_tensors_into_shards",
    "plan_units",
]

# The LightningModule is the FSDP root, but Lightning calls these instead of forward().
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


@dataclass(frozen=True)
class ShardedUnit:
    """One module that ``fully_shard`` turns into a unit: its parameters are gathered together."""

    name: str
    module: nn.Module
    mp_policy: MixedPrecisionPolicy
    num_params: int  # parameters this unit manages itself, not those of units nested in it


def plan_units(
    model: nn.Module, wrap_policy: ModulePolicy | None, *, mp_policy: MixedPrecisionPolicy, keep_norms_fp32: bool
) -> list[ShardedUnit]:
    """The units to shard inside ``model`` (the root is not included), children before parents.

    Beyond the policy's blocks: normalization layers under mixed precision (kept in fp32). Everything
    else belongs to the root; small modules of their own (embeddings, a final norm) would each cost a
    collective per step for little memory. A module whose parameters are shared with a module outside
    it (tied embeddings) is left to its parent, since one parameter can belong to one unit only.
    Subtrees the user already sharded stay as they are.
    """
    named = list(model.named_modules())
    user_sharded = [name for name, module in named[1:] if isinstance(module, FSDPModule)]
    owners = _parameter_owners(model)

    def eligible(name: str, module: nn.Module) -> bool:
        inside_user_unit = any(name == u or name.startswith(u + ".") for u in user_sharded)
        return not inside_user_unit and not _shares_parameters_outside(name, module, owners)

    chosen: dict[str, MixedPrecisionPolicy] = {}
    if wrap_policy is not None:
        chosen.update((name, mp_policy) for name, module in select_modules(model, wrap_policy) if eligible(name, module))
    if keep_norms_fp32:
        chosen.update((name, FULL_PRECISION_POLICY) for name, module in named[1:] if is_normalization(module) and eligible(name, module))

    units = []
    for name, module in reversed(named[1:]):  # post-order: fully_shard must see inner units first
        if name in chosen:
            nested = [n for n in chosen if n.startswith(name + ".")]
            nested_params = {id(p) for n in nested for p in model.get_submodule(n).parameters()}
            num_params = sum(p.numel() for p in module.parameters() if id(p) not in nested_params)
            units.append(ShardedUnit(name, module, chosen[name], num_params))
    return units


def apply_fully_shard(
    model: nn.Module,
    units: Sequence[ShardedUnit],
    mesh: DeviceMesh,
    *,
    root_mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    reshard_after_forward: bool | int,
) -> None:
    """Shards each unit, then ``model`` itself as the root, and routes its step methods through FSDP."""
    for unit in units:
        fully_shard(
            unit.module,
            mesh=mesh,
            mp_policy=unit.mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )
    # The root's parameters are needed again right after its "forward" (the whole *_step) ends,
    # so resharding them in between would only add an all-gather. Its "forward" receives the batch:
    # hand it over unchanged, as DDP does, and let autocast choose compute dtypes.
    root_policy = dataclasses.replace(root_mp_policy, cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, mp_policy=root_policy, offload_policy=offload_policy, reshard_after_forward=False)
    for method in STEP_METHODS:
        if hasattr(model, method) and _is_user_method(model, method):
            register_fsdp_forward_method(model, method)


def load_full_tensors_into_shards(model: nn.Module) -> list[RemovableHandle]:
    """Lets ``module.load_state_dict`` take plain full tensors, as a module under DDP does, while ``model``
    is sharded: each rank keeps its own shard of every full tensor given for a sharded parameter.

    Callbacks and user code restore weights this way in the middle of training (Lightning's
    ModelCheckpoint under manual optimization, "restore the best weights" callbacks); every rank then
    holds the same full tensors, so slicing needs no communication.
    """
    handles = []
    for module in model.modules():
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            handles.append(module.register_load_state_dict_pre_hook(_shard_full_tensors))
    return handles


def _shard_full_tensors(module: nn.Module, state_dict: dict, prefix: str, *_: object) -> None:
    # load_state_dict hands hooks its own copy of the dict: replacing entries leaves the caller's intact.
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if value.shape == param.shape:
                local = value.to(device=param.to_local().device, dtype=param.dtype)
                state_dict[prefix + name] = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)


def _is_user_method(model: nn.Module, method: str) -> bool:
    from lightning.pytorch import LightningModule

    return not isinstance(model, LightningModule) or is_overridden(method, model, parent=LightningModule)


def apply_activation_checkpointing(modules: Sequence[tuple[str, nn.Module]]) -> None:
    """Recomputes each module's forward in backward instead of storing its activations.

    The module keeps its class and parameter names (no wrapper module), so state-dict keys and
    checkpoints look the same with and without activation checkpointing.
    """
    for _, module in modules:
        forward = module.forward

        @functools.wraps(forward)
        def checkpointed_forward(*args, _forward=forward, **kwargs):  # type: ignore[no-untyped-def]
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        module.forward = checkpointed_forward  # type: ignore[method-assign]


def apply_compile(modules: Sequence[tuple[str, nn.Module]], *, backend: str = "inductor") -> None:
    """Compiles each block on its own: repeated blocks share one compiled graph, and FSDP's
    collectives stay at the block boundaries, outside the graphs."""
    for _, module in modules:
        module.compile(backend=backend)


def _parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    return owners


def _shares_parameters_outside(name: str, module: nn.Module, owners: dict[int, list[str]]) -> bool:
    prefix = name + "."
    return any(not other.startswith(prefix) for p in module.parameters() for other in owners[id(p)])
