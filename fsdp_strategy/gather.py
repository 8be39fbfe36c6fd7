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

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fsdp_strategy._compat import forget_composable_state
from fsdp_strategy.state_bytes import full_bytes, model_state_tensors

__all__ = ["ShardingSnapshot", "all_ranks_agree", "full_state_bytes", "host_memory_available", "unshard"]


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
            removed = set()
            for name, registry in _hook_registries(module).items():
                for hook_id, hook in list(registry.items()):
                    if hook_id not in before.hooks.get(name, ()) and _from_torch_distributed(hook):
                        removed.add(hook_id)
            for registry in _hook_registries(module).values():
                for hook_id in removed:
                    registry.pop(hook_id, None)  # also the per-hook flags (with_kwargs, always_called)
            for name in self._added.get(key, ()):
                module.__dict__.pop(name, None)
            module.__class__ = before.cls
            forget_composable_state(module)


def _hook_registries(module: nn.Module) -> dict[str, dict]:
    # nn.Module keeps its hooks (and per-hook flags) in dicts named _*hooks*.
    return {name: value for name, value in module.__dict__.items() if name.startswith("_") and "hooks" in name and isinstance(value, dict)}


def _state(module: nn.Module) -> _Before:
    hooks = {name: frozenset(registry) for name, registry in _hook_registries(module).items()}
    return _Before(type(module), frozenset(module.__dict__), hooks)


def _from_torch_distributed(hook: Any) -> bool:
    function = getattr(hook, "__func__", hook)
    return getattr(function, "__module__", "").startswith("torch.distributed.")


def full_state_bytes(model: nn.Module, optimizers: Iterable[Optimizer]) -> int:
    """Bytes the gathered parameters and optimizer states take on each rank."""
    return full_bytes(model_state_tensors(model, optimizers, gradients=False))


def host_memory_available() -> int | None:
    """``MemAvailable`` of this host in bytes (Linux), ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def unshard(model: nn.Module, before: ShardingSnapshot, optimizers: Iterable[Optimizer], *, device: torch.device) -> None:
    """Gathers every DTensor parameter (and optimizer state) of ``model`` into full tensors on ``device``
    and gives each module back its original class, hooks, attributes and Parameter objects, now holding the
    full values. Collective: every rank calls it."""
    optimizers = list(optimizers)
    with torch.no_grad():
        full = {id(p): _full(p, device) for p in _unique_dtensors(model)}
        replacements: dict[int, nn.Parameter] = {}
        for module in model.modules():  # pair each sharded parameter with the object it replaced
            for name, param in module._parameters.items():
                if param is not None and id(param) in full and id(param) not in replacements:
                    original = before.original(module, name)
                    if original is None or original.is_meta:  # added later, or never allocated: a new one
                        original = nn.Parameter(full[id(param)], requires_grad=param.requires_grad)
                    else:
                        original.data = full[id(param)]
                        original.requires_grad_(param.requires_grad)
                    replacements[id(param)] = original
        before.restore()
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and id(param) in replacements:
                    setattr(module, name, replacements[id(param)])
        for optimizer in optimizers:
            _swap_optimizer(optimizer, replacements, device)


def _unique_dtensors(model: nn.Module) -> list[DTensor]:
    # The same order on every rank: each full_tensor() below is a collective.
    return [p for p in {id(p): p for p in model.parameters()}.values() if isinstance(p, DTensor)]


def _full(tensor: DTensor, device: torch.device) -> Tensor:
    return tensor.full_tensor().to(device)


def _swap_optimizer(optimizer: Optimizer, replacements: dict[int, nn.Parameter], device: torch.device) -> None:
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            new = replacements.get(id(param))
            if new is None:
                continue
            state = optimizer.state.pop(param, None)
            if state is not None:
                optimizer.state[new] = {k: _full(v, device) if isinstance(v, DTensor) else v for k, v in state.items()}
            group["params"][index] = new


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """``True`` only when ``flag`` is true on every rank (one all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
