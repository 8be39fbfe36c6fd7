"""Small verbs that turn a plain module into a sharded one: plan units, checkpoint, compile, shard.

Each takes only what it needs and works without Lightning; :meth:`fsdp_strategy.stage.ModuleSharding.parallelize`
calls them in order.
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
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from fsdp_strategy._compat import tree_map
from fsdp_strategy.sharding.mixed_precision import FULL_PRECISION_POLICY, is_normalization
from fsdp_strategy.sharding.policy import ModulePolicy, select_modules

__all__ = [
    "STEP_METHODS",
    "ShardedUnit",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fully_shard",
    "load_full_tensors_into_shards",
    "plan_units",
    "reshard_units",
]

# The LightningModule is the FSDP root, but Lightning calls these instead of forward().
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


@dataclass(frozen=True)
class ShardedUnit:
    """What ``fully_shard`` turns into one unit: one module, or several sharded together
    (``fully_shard([modules])``), whose parameters are gathered together."""

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    mp_policy: MixedPrecisionPolicy
    num_params: int  # parameters this unit manages itself, not those of units nested in it
    # None: the strategy's reshard_after_forward; False: gathered once per forward and backward.
    reshard_after_forward: bool | None = None
    input_dtype: torch.dtype | None = None  # floating-point inputs of each module cast to it (cast_inputs)

    @property
    def name(self) -> str:
        return ", ".join(self.names)

    @property
    def module(self) -> nn.Module:
        """The unit's module; the first one of a group."""
        return self.modules[0]


def plan_units(
    model: nn.Module, wrap_policy: ModulePolicy | None, *, mp_policy: MixedPrecisionPolicy, keep_norms_fp32: bool
) -> list[ShardedUnit]:
    """The units to shard inside ``model`` (the root is not included), in the order to shard them.

    1. Under mixed precision, every normalization layer, as one fp32 group not resharded after forward:
       norms are tiny, and one group costs one all-gather and one reduce-scatter per micro-batch where a
       unit per norm costs two all-gathers and a reduce-scatter each.
    2. The policy's blocks.
    3. Everything else below the root (embeddings, final norm, output head, tied weights, small heads)
       as one group not resharded after forward: gathered once when its first module runs and kept
       until backward, as torchtitan and Accelerate shard the embedding and the tail. The root then
       holds only its own parameters. Registering ``training_step`` as an FSDP forward reshards the
       root when the step ends, so backward gathers it again: keeping the rest out of the root saves
       that second all-gather of the largest tensors (a large vocabulary's embedding).

    A module whose parameters are shared with a module outside it (tied embeddings) is never a block
    or norm unit, since one parameter can belong to one unit only; it joins the group of step 3 with
    the module it shares with, or stays in the root when it shares with the root's own parameters.
    Subtrees the user already sharded stay as they are.
    """
    named = list(model.named_modules())
    user_sharded = [name for name, module in named[1:] if isinstance(module, FSDPModule)]
    owners = _parameter_owners(model)

    def inside(name: str, prefixes: Sequence[str]) -> bool:
        return any(name == u or name.startswith(u + ".") for u in prefixes)

    def eligible(name: str, module: nn.Module) -> bool:
        return not inside(name, user_sharded) and not _shares_parameters_outside(name, module, owners)

    blocks: dict[str, nn.Module] = {}
    if wrap_policy is not None:
        blocks.update((name, module) for name, module in select_modules(model, wrap_policy) if eligible(name, module))
    norms = []
    if keep_norms_fp32:
        norms = [(name, module) for name, module in named[1:] if is_normalization(module) and eligible(name, module)]

    units: list[ShardedUnit] = []
    claimed: set[int] = set()  # parameters of the units planned so far
    if norms:
        units.append(
            _unit(norms, FULL_PRECISION_POLICY, claimed, reshard_after_forward=False, input_dtype=torch.float32)
        )
    # post-order: fully_shard must see inner units first
    for name, module in reversed(named[1:]):
        if name in blocks:
            units.append(_unit([(name, module)], mp_policy, claimed))
    rest = _rest_of_the_model(model, claimed, [*user_sharded, *blocks, *(name for name, _ in norms)])
    if rest:
        units.append(_unit(rest, mp_policy, claimed, reshard_after_forward=False))
    return units


def _unit(
    members: Sequence[tuple[str, nn.Module]],
    mp_policy: MixedPrecisionPolicy,
    claimed: set[int],
    *,
    reshard_after_forward: bool | None = None,
    input_dtype: torch.dtype | None = None,
) -> ShardedUnit:
    params = {id(p): p for _, module in members for p in module.parameters() if id(p) not in claimed}
    claimed.update(params)
    return ShardedUnit(
        names=tuple(name for name, _ in members),
        modules=tuple(module for _, module in members),
        mp_policy=mp_policy,
        num_params=sum(p.numel() for p in params.values()),
        reshard_after_forward=reshard_after_forward,
        input_dtype=input_dtype,
    )


def _rest_of_the_model(model: nn.Module, claimed: set[int], units: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The outermost modules below the root that hold parameters of no unit and contain no unit.

    A module whose parameters are also the root's own (registered on the root itself) is left to the root.
    """
    root_own = {id(p) for p in model.parameters(recurse=False)}
    members = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if name in units:
                continue
            free = [p for p in child.parameters() if id(p) not in claimed]
            if not free:
                continue
            if any(u.startswith(name + ".") for u in units):
                visit(name, child)  # its own parameters beyond the units stay in the root
            elif not any(id(p) in root_own for p in free):
                members.append((name, child))

    visit("", model)
    return members


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
            unit.modules[0] if len(unit.modules) == 1 else list(unit.modules),
            mesh=mesh,
            mp_policy=unit.mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward
            if unit.reshard_after_forward is None
            else unit.reshard_after_forward,
        )
        if unit.input_dtype is not None:
            for module in unit.modules:
                cast_inputs(module, unit.input_dtype)
    # The root's "forward" (the whole *_step) receives the batch: hand it over unchanged, as DDP does,
    # and let autocast choose compute dtypes. Its own parameters, if any, are needed again right after
    # the step, so resharding them in between would only add an all-gather.
    root_policy = dataclasses.replace(root_mp_policy, cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, mp_policy=root_policy, offload_policy=offload_policy, reshard_after_forward=False)
    # Lightning calls the step methods, not forward: routed through the root's FSDP hooks, they gather
    # the root's own parameters (a step may use them without calling forward) and start each pass.
    for method in STEP_METHODS:
        if hasattr(model, method) and _is_user_method(model, method):
            register_fsdp_forward_method(model, method)


def cast_inputs(module: nn.Module, dtype: torch.dtype) -> RemovableHandle:
    """Casts the floating-point tensors among ``module``'s inputs to ``dtype`` before each forward, as FSDP's
    ``cast_forward_inputs`` does, also when activation checkpointing recomputes the forward in backward (a module
    hook runs again then; FSDP's cast did not before torch 2.13)."""

    def cast(value: object) -> object:
        if isinstance(value, torch.Tensor) and torch.is_floating_point(value) and value.dtype != dtype:
            return value.to(dtype)
        return value

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def reshard_units(model: nn.Module) -> None:
    """Frees every gathered unit of ``model``, the root included.

    Units not resharded after forward stay gathered until a backward frees them. A forward without
    backward (an evaluation step, a ``no_grad`` forward in a manual step) would leave them gathered,
    holding values that an optimizer step or a weight load then makes stale, and would hand FSDP's
    unsharded parameters to code that expects the shards. A unit already sharded is left as it is.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


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
                state_dict[prefix + name] = distribute_tensor(
                    local, param.device_mesh, param.placements, src_data_rank=None
                )


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
