"""An optimizer's state in and out of checkpoints, as the optimizer itself holds it: nothing is stepped.

torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` first give an optimizer without state one
step (learning rate 0, zero gradients) and then ``zero_grad()``, so that its state has every entry to save or
load into. That calls the user's ``optimizer.step()`` at every save (plain SGD never has state), and drops the
gradients a save in the middle of a manual step holds. DDP's checkpoints never touch the optimizer: Lightning
reads ``optimizer.state_dict()`` and calls ``optimizer.load_state_dict()``. This module does the same around
the shards:

* sharded checkpoints keep the layout torch's helpers write (``state.<parameter name>.<entry>`` and
  ``param_groups.<i>.<field>``, DTensor entries in shards), so Distributed Checkpoints written before read
  the same; what a checkpoint holds is read from its metadata, not from a stepped optimizer;
* full checkpoints hold Lightning's layout (entries by parameter index) with whole tensors, as DDP writes.

A state entry shaped like its parameter is sharded like it; any other entry (Adam's ``step``) is whole on
every rank, as the optimizer keeps it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

__all__ = [
    "full_state",
    "load_full_state",
    "load_sharded_template",
    "parameter_names",
    "read_param_groups",
    "sharded_state",
    "unflatten",
]


def parameter_names(model: nn.Module, optimizer: Optimizer) -> list[str]:
    """The name in ``model`` of each of the optimizer's parameters, in the order the optimizer numbers them."""
    names = {id(p): name for name, p in model.named_parameters()}
    missing = [i for i, p in enumerate(_parameters(optimizer)) if id(p) not in names]
    if missing:
        raise ValueError(
            f"The optimizer holds parameters that are not the model's (indices {missing[:5]}): a checkpoint names each"
            " parameter's state by its name in the model. Build the optimizer from `self.parameters()` in"
            " `configure_optimizers()`."
        )
    return [names[id(p)] for p in _parameters(optimizer)]


def _parameters(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def sharded_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name, DTensor entries as they are (for a sharded save)."""
    saved = optimizer.state_dict()
    if _holds_no_state(saved):
        return saved
    names = parameter_names(model, optimizer)
    return {
        "state": {names[index]: dict(entries) for index, entries in saved["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in saved["param_groups"]],
    }


def full_state(optimizer: Optimizer, *, keep: bool) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor entry gathered whole on the CPU (a collective per entry,
    so every rank calls it); ``{}`` where not ``keep``, which then never holds more than one entry at a time."""
    saved = optimizer.state_dict()
    if _holds_no_state(saved):
        return saved if keep else {}
    state: dict[int, dict[str, Any]] = {}
    for index in sorted(saved["state"]):
        entries = {}
        for key, value in saved["state"][index].items():
            if isinstance(value, DTensor):
                value = value.full_tensor().cpu()
            entries[key] = value
        if keep:
            state[index] = entries
    return {"state": state, "param_groups": saved["param_groups"]} if keep else {}


def load_full_state(optimizer: Optimizer, saved: Mapping[str, Any]) -> None:
    """Loads a full optimizer state (Lightning's layout, whole tensors, the same on every rank): each rank keeps
    its shard of every entry shaped like a sharded parameter. No communication."""
    if _holds_no_state(saved):
        optimizer.load_state_dict(dict(saved))
        return
    params = _parameters(optimizer)
    state: dict[int, dict[str, Any]] = {}
    for index, entries in saved["state"].items():
        param = params[index] if isinstance(index, int) and index < len(params) else None
        state[index] = {key: _shard_like(value, param) for key, value in entries.items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _holds_no_state(saved: Mapping[str, Any]) -> bool:
    # Lightning's stand-in optimizer when `configure_optimizers` returns None gives `{}`: saved and loaded as it is,
    # as DDP does.
    return "state" not in saved


def _shard_like(value: Any, param: Tensor | None) -> Any:
    if not isinstance(param, DTensor) or not isinstance(value, Tensor) or isinstance(value, DTensor):
        return value
    if value.shape != param.shape:
        return value
    local = value.to(device=param.to_local().device)
    return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)


def read_param_groups(metadata: Metadata, load: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """The saved optimizers' ``param_groups`` (parameters by name), one list per ``optimizer_<i>`` entry in order.

    ``load`` fills a flat DCP state dict (``dcp.load`` with the checkpoint's reader): only these small entries
    are read, before any optimizer exists, so that ``on_load_checkpoint`` sees them as under DDP.
    """
    flat: dict[str, Any] = {k: None for k in metadata.state_dict_metadata if _GROUP_KEY.match(k)}
    if flat:
        load(flat)
    optimizers: dict[int, dict[int, dict[str, Any]]] = {}
    for key, value in flat.items():
        match = _GROUP_KEY.match(key)
        assert match is not None
        optimizers.setdefault(int(match["optimizer"]), {}).setdefault(int(match["group"]), {})[match["field"]] = value
    return [[groups[g] for g in sorted(groups)] for _, groups in sorted(optimizers.items())]


_GROUP_KEY = re.compile(r"^optimizer_(?P<optimizer>\d+)\.param_groups\.(?P<group>\d+)\.(?P<field>.+)$")


def load_sharded_template(metadata: Metadata, prefix: str, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The flat DCP state dict to load the state entries of the optimizer saved under ``prefix`` (``"optimizer_0."``)
    into: a DTensor laid out as its parameter for an entry of the parameter's shape, a whole tensor for any other."""
    by_name = dict(zip(parameter_names(model, optimizer), _parameters(optimizer)))
    # Longest names first: "blocks.1.weight" must not be taken for "blocks.1" plus an entry "weight".
    names = sorted(by_name, key=len, reverse=True)
    template: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith(prefix + "state."):
            continue
        if not isinstance(item, TensorStorageMetadata):
            template[key] = None  # a plain value: DCP puts the saved one in its place
            continue
        param = _owner(key[len(prefix) + len("state.") :], names, by_name)
        dtype = item.properties.dtype
        if isinstance(param, DTensor) and tuple(item.size) == tuple(param.shape):
            template[key] = torch.empty_like(param, dtype=dtype)
        else:
            device = (
                param.to_local().device if isinstance(param, DTensor) else param.device if param is not None else "cpu"
            )
            template[key] = torch.empty(item.size, dtype=dtype, device=device)
    return template


def _owner(entry: str, names: Iterable[str], by_name: Mapping[str, Tensor]) -> Tensor | None:
    name = next((n for n in names if entry.startswith(n + ".")), None)
    return None if name is None else by_name[name]


def unflatten(
    flat: Mapping[str, Any], param_groups: list[dict[str, Any]], prefix: str, model: nn.Module, optimizer: Optimizer
) -> dict[str, Any]:
    """``optimizer.load_state_dict``'s argument from the loaded state entries under ``prefix`` and the saved
    ``param_groups`` (parameters by name)."""
    names = parameter_names(model, optimizer)
    index = {name: i for i, name in enumerate(names)}
    longest_first = sorted(names, key=len, reverse=True)
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        entry = key[len(prefix) + len("state.") :]
        name = next((n for n in longest_first if entry.startswith(n + ".")), None)
        if name is None:
            raise KeyError(f"The checkpoint's '{key}' belongs to no parameter of the optimizer.")
        state.setdefault(index[name], {})[entry[len(name) + 1 :]] = value
    # optimizer.load_state_dict pairs saved indices with its parameters by position: number them as they stand now.
    groups, start = [], 0
    for number, current in enumerate(optimizer.param_groups):
        saved = param_groups[number] if number < len(param_groups) else {}
        wanted = names[start : start + len(current["params"])]
        if sorted(saved.get("params", [])) != sorted(wanted):
            raise ValueError(
                f"Parameter group {number} of the optimizer holds {_few(wanted)}; the checkpoint's holds"
                f" {_few(saved.get('params', []))}. The optimizer must be built as it was when the checkpoint was saved."
            )
        groups.append({**saved, "params": list(range(start, start + len(current["params"])))})
        start += len(current["params"])
    return {"state": state, "param_groups": groups}


def _few(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return f"{len(names)} parameters ({shown}{', ...' if len(names) > limit else ''})"
