"""Turning a sharded module back into the plain module the user built, as DDP leaves it after ``fit``.

Scripts use the module they passed to ``fit`` afterwards: rank-0-only inference, ``model.state_dict()``,
``load_state_dict`` of a plain state dict, ``torch.save(trainer.model)``, callbacks that copy weights
into a plain copy. Under DDP all of that works because the module was never changed. ``fully_shard``
changes it in place: its class becomes a generated ``FSDP<Class>``, its parameters become DTensor
shards, and hooks that gather them run in every forward (a forward on one rank alone then waits for the
others forever).

:func:`snapshot` records, just before sharding, what each module looked like; :func:`unshard` puts it
back: the original classes, the hooks and attributes that sharding added removed, every parameter
gathered into a full ``nn.Parameter`` (tied ones stay tied), and the optimizers' parameters and states
swapped for full ones, so that saving a checkpoint after ``fit`` still works. Nothing of FSDP's
internals is named: the difference between before and after sharding is what gets removed.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import gc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fsdp_strategy._compat import forget_composable_state, unsharded_parameters
from fsdp_strategy.sharding.state_bytes import full_bytes, model_state_tensors

__all__ = [
    "plain_optimizers",
    "sharded_optimizers",
    "ShardingSnapshot",
    "full_state_bytes",
    "gathered_parameters",
    "unshard",
]


@dataclass(frozen=True)
class _Before:
    cls: type
    attributes: frozenset[str]
    hooks: dict[str, frozenset[Any]]


class ShardingSnapshot:
    """What each module of a model looked like before ``fully_shard``."""

    def __init__(self, model: nn.Module) -> None:
        self._modules = {id(m): (m, _state(m)) for m in model.modules()}
        self._added: dict[int, frozenset[str]] = {}
        self._sharded_of: dict[int, Tensor] = {}
        # The Parameter objects the user's code (and an optimizer kept from an earlier stage) refer to: they
        # are given back, holding the trained values, rather than new ones.
        self._parameters = {
            (id(m), name): param for m in model.modules() for name, param in m._parameters.items() if param is not None
        }

    def added(self) -> None:
        """Call right after sharding: remembers the attributes that sharding added to each module, so that
        :meth:`restore` removes exactly those (and not what user code sets later), and lets go of the full
        values of the parameters that sharding replaced (until :meth:`restore` refills them)."""
        for key, (module, before) in self._modules.items():
            self._added[key] = frozenset(module.__dict__) - before.attributes
        for param in self._parameters.values():
            if not param.is_meta:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def replacements(self) -> dict[int, nn.Parameter]:
        """What now stands, in the sharded module, for each Parameter object from before sharding (by id)."""
        return {
            id(param): current
            for (key, name), param in self._parameters.items()
            if (current := self._modules[key][0]._parameters.get(name)) is not None and current is not param
        }

    def original(self, module: nn.Module, name: str) -> nn.Parameter | None:
        return self._parameters.get((id(module), name))

    def restore(self) -> None:
        """Original classes back; the attributes sharding added and the hooks torch.distributed added removed.

        Hooks are told apart by where their function lives, since FSDP registers some lazily, in the first
        forward, after :meth:`added` ran; hooks that user code registered meanwhile stay.
        """
        for key, (module, before) in self._modules.items():
            removed = _added_hooks(module, before, _from_torch_distributed)
            for registry in _hook_registries(module).values():
                for hook_id in removed:
                    registry.pop(hook_id, None)  # also the per-hook flags (with_kwargs, always_called)
            for name in self._added.get(key, ()):
                module.__dict__.pop(name, None)
            module.__class__ = before.cls
            forget_composable_state(module)
        self._sharded_of = {}

    def pair_gathered(self, pairs: Iterable[tuple[Tensor, Tensor]]) -> None:
        """Remembers the sharded parameter behind each of FSDP2's gathered ones (:func:`gathered_parameters`), so
        that a copy made while a unit is gathered takes the full-precision shards, not the gathered compute copies."""
        self._sharded_of = {id(gathered): sharded for sharded, gathered in pairs}

    def plain_view(self, root: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        """A stand-in for ``root`` (a module of the sharded model) as it would be unsharded: new module objects of the
        original classes holding the attributes and hooks from before sharding (user hooks added since are kept),
        and each sharded parameter gathered into a new full ``nn.Parameter`` (tied ones stay tied). Nothing of the
        live module changes. Returns the stand-in and the gathered parameters. Collective: every rank calls it.
        """
        gathered: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for module in root.modules():  # the same order on every rank: each full_tensor() is a collective
                for param in module._parameters.values():
                    sharded = self._sharded_of.get(id(param), param) if param is not None else None
                    if isinstance(sharded, DTensor) and id(param) not in gathered:
                        gathered[id(param)] = nn.Parameter(_full_copy(sharded), requires_grad=sharded.requires_grad)
        views: dict[int, nn.Module] = {}

        def view(module: nn.Module) -> nn.Module:
            if id(module) in views:
                return views[id(module)]
            entry = self._modules.get(id(module))
            before = entry[1] if entry is not None else _state(module)
            state = {k: v for k, v in module.__dict__.items() if k not in self._added.get(id(module), ())}
            removed = _added_hooks(module, before, _from_this_package_or_torch_distributed)
            for name, registry in _hook_registries(module).items():
                state[name] = type(registry)((k, v) for k, v in registry.items() if k not in removed)
            state["_parameters"] = {
                n: gathered.get(id(p), p) if p is not None else None for n, p in module._parameters.items()
            }
            state["_modules"] = {n: view(c) if c is not None else None for n, c in module._modules.items()}
            copy = object.__new__(before.cls)
            copy.__dict__.update(state)
            views[id(module)] = copy
            return copy

        return view(root), list({id(p): p for p in gathered.values()}.values())

    def enable_copies(self, model: nn.Module) -> None:
        """Lets ``copy.deepcopy``, ``pickle`` and ``torch.save`` take any module of the sharded ``model`` as under DDP:
        the copy is a plain module of the original class with full parameters (see :meth:`plain_view`). FSDP2
        refuses to deep-copy its modules ("FSDP does not support deepcopy"). Call before :meth:`added`, so that
        giving the module back removes these attributes too."""
        for module in model.modules():
            module.__dict__["__deepcopy__"] = functools.partial(_deepcopy, self, module)
            module.__dict__["__reduce_ex__"] = functools.partial(_reduce_ex, self, module)


def _full_copy(tensor: DTensor) -> Tensor:
    full = tensor.full_tensor()
    # With one shard the "gathered" tensor can be the shard itself, which training goes on to change.
    return full.clone() if full.untyped_storage().data_ptr() == tensor.to_local().untyped_storage().data_ptr() else full


def _deepcopy(snapshot: ShardingSnapshot, module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    view, gathered = snapshot.plain_view(module)
    for param in gathered:  # new tensors already: the copy takes them as they are
        memo[id(param)] = param
    copied = copy.deepcopy(view, memo)
    memo[id(module)] = copied
    return copied


def _reduce_ex(snapshot: ShardingSnapshot, module: nn.Module, protocol: int) -> Any:
    view, _ = snapshot.plain_view(module)
    reduced = view.__reduce_ex__(protocol)
    if reduced[0] is copyreg.__newobj__:
        # pickle refuses __newobj__ of a class other than the pickled object's (FSDP's generated subclass here);
        # the stand-in's class is rebuilt the way protocols 0 and 1 rebuild an object.
        cls = reduced[1][0]
        reduced = (copyreg._reconstructor, (cls, object, None), *reduced[2:])
    return reduced


def gathered_parameters(model: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """``(sharded, gathered)`` for each parameter of the sharded ``model``: FSDP2's gathered (unsharded) parameter
    of each, created at a unit's first all-gather and reused by every later one. Under tensor parallelism a gathered
    parameter is still a DTensor (split over the ``tensor_parallel`` dimension). Collective; call it before any
    forward.

    Made without gathering where this torch allows (:func:`~fsdp_strategy._compat.unsharded_parameters`): a real
    all-gather of the largest unit (often the embedding and the head together) needed twice its full size on top
    of the shards on CPU, the peak of the strategy's whole setup. Otherwise one unit at a time is gathered and
    resharded: while a unit is gathered, ``named_parameters()`` yields the gathered tensors of the parameters it
    manages and the sharded ones for the others."""
    from torch.distributed.fsdp import FSDPModule

    sharded = dict(model.named_parameters())
    pairs: dict[str, tuple[Tensor, Tensor]] = {}
    for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        made = unsharded_parameters(unit)
        if made is not None:
            for name, param in sharded.items():
                if id(param) in made and name not in pairs and isinstance(param, DTensor):
                    pairs[name] = (param, made[id(param)])
            continue
        unit.unshard()
        for name, param in model.named_parameters():
            if param is not sharded.get(name) and name not in pairs and isinstance(sharded.get(name), DTensor):
                pairs[name] = (sharded[name], param)
        unit.reshard()
    return list(pairs.values())


def _added_hooks(module: nn.Module, before: _Before, added_by: Any) -> set[Any]:
    """Ids of the hooks registered on ``module`` since ``before`` whose function ``added_by`` accepts."""
    found = set()
    for name, registry in _hook_registries(module).items():
        for hook_id, hook in registry.items():
            if hook_id not in before.hooks.get(name, ()) and added_by(hook):
                found.add(hook_id)
    return found


def _hook_registries(module: nn.Module) -> dict[str, dict]:
    # nn.Module keeps its hooks (and per-hook flags) in dicts named _*hooks*.
    return {
        name: value
        for name, value in module.__dict__.items()
        if name.startswith("_") and "hooks" in name and isinstance(value, dict)
    }


def _state(module: nn.Module) -> _Before:
    hooks = {name: frozenset(registry) for name, registry in _hook_registries(module).items()}
    return _Before(type(module), frozenset(module.__dict__), hooks)


def _from_torch_distributed(hook: Any) -> bool:
    return _hook_module(hook).startswith("torch.distributed.")


def _from_this_package_or_torch_distributed(hook: Any) -> bool:
    # The strategy's own per-step hooks (unit order, unused parameters) must not follow a module into its copy.
    return _from_torch_distributed(hook) or _hook_module(hook).startswith("fsdp_strategy.")


def _hook_module(hook: Any) -> str:
    function = getattr(hook, "__func__", hook)
    function = getattr(function, "func", function)  # functools.partial
    return getattr(function, "__module__", "") or ""


def full_state_bytes(model: nn.Module, optimizers: Iterable[Optimizer]) -> int:
    """Bytes the gathered parameters and optimizer states take on each rank."""
    return full_bytes(model_state_tensors(model, optimizers, gradients=False))


def unshard(
    model: nn.Module, before: ShardingSnapshot, optimizers: Iterable[Optimizer], *, device: torch.device
) -> None:
    """Gathers every DTensor parameter of ``model`` into a full tensor on ``device`` and gives each module back its
    original class, hooks, attributes and Parameter objects, now holding the full values. Collective: every rank
    calls it.

    One parameter at a time, so that giving the module back never needs more memory than training did: FSDP's
    state goes first, then each shard is gathered, put in place of its parameter (in the modules and in the
    optimizers) and let go. The optimizers' states stay sharded: nothing reads them after a stage unless a
    checkpoint is saved, which gathers them entry by entry (:mod:`fsdp_strategy.checkpoint.optimizer_state`).
    """
    optimizers = list(optimizers)
    shards = _unique_dtensors(model)
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and isinstance(param, DTensor):
                owners.setdefault(id(param), []).append((module, name))
    before.restore()
    gc.collect()  # FSDP's state (cycles of modules, units and parameters) holds the shards until it is collected
    with torch.no_grad():
        for index, param in enumerate(shards):
            full = param.full_tensor().to(device)
            module, name = owners[id(param)][0]
            original = before.original(module, name)
            if original is None or original.is_meta:  # added later, or never allocated: a new one
                original = nn.Parameter(full, requires_grad=param.requires_grad)
            else:
                original.data = full
                original.requires_grad_(param.requires_grad)
            for module, name in owners[id(param)]:
                module._parameters[name] = original
            for optimizer in optimizers:
                _swap_parameter(optimizer, param, original)
            shards[index] = None  # type: ignore[call-overload]
            del param  # the shard, and its gradient, go now


def _unique_dtensors(model: nn.Module) -> list[DTensor]:
    # The same order on every rank: each full_tensor() below is a collective.
    return [p for p in {id(p): p for p in model.parameters()}.values() if isinstance(p, DTensor)]


def _swap_parameter(optimizer: Optimizer, old: nn.Parameter, new: nn.Parameter) -> None:
    """``new`` in place of ``old`` in the optimizer's groups and as the key of its state (which stays as it is)."""
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    if old in optimizer.state:
        optimizer.state[new] = optimizer.state.pop(old)


def plain_optimizers(optimizers: Iterable[Any]) -> list[Optimizer]:
    """The torch optimizers behind Lightning's ``LightningOptimizer`` wrappers."""
    return [o.optimizer if isinstance(o, LightningOptimizer) else o for o in optimizers]


def sharded_optimizers(optimizers: Iterable[Any]) -> list[Optimizer]:
    """The optimizers of the current sharded model (a stage after fit keeps fit's optimizers, whose
    parameters were given back in full)."""
    return [
        o
        for o in plain_optimizers(optimizers)
        if any(isinstance(p, DTensor) for g in o.param_groups for p in g["params"])
    ]
