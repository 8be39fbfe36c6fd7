"""Checkpoints of sharded models: a Distributed Checkpoint directory, or one full Lightning file.

The sharded layout matches Lightning's own (DCP shards with the model under ``"model"`` and
optimizers under ``"optimizer_0"``, ..., trainer state in ``meta.pt``), so
``python -m lightning.pytorch.utilities.consolidate_checkpoint`` reads it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

__all__ = [
    "METADATA_FILENAME",
    "is_sharded_checkpoint",
    "load_full",
    "load_sharded",
    "model_state",
    "optimizer_state",
    "save_sharded",
]

METADATA_FILENAME = "meta.pt"
MODEL_KEY = "model"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def model_state(model: nn.Module, *, full: bool) -> dict[str, Any]:
    """Sharded: this rank's DTensor shards. Full: whole tensors on CPU on rank 0, empty elsewhere."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def optimizer_state(model: nn.Module, optimizer: Optimizer, *, full: bool) -> dict[str, Any]:
    """The optimizer state keyed by parameter names; full form keyed by parameter index, as Lightning's."""
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    if full and state:
        state = _names_to_indices(state, _parameter_names(model, optimizer))
    return state


def save_sharded(path: Path, checkpoint: dict[str, Any], *, is_rank_zero: bool) -> None:
    """Every rank writes its shards of the model and optimizer states; rank 0 writes the rest to ``meta.pt``."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {MODEL_KEY: checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(tensors, checkpoint_id=path)
    if is_rank_zero:
        torch.save(checkpoint, path / METADATA_FILENAME)


def load_sharded(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], *, strict: bool) -> dict[str, Any]:
    """Loads shards into the (already sharded) model and optimizers, resharding as needed; returns the trainer state."""
    tensors: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
    tensors.update({f"optimizer_{i}": get_optimizer_state_dict(model, opt) for i, opt in enumerate(optimizers)})
    dcp.load(tensors, checkpoint_id=path)
    set_model_state_dict(model, tensors[MODEL_KEY], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, tensors[f"optimizer_{i}"])
    return torch.load(path / METADATA_FILENAME, weights_only=False)


def load_full(
    checkpoint: dict[str, Any], model: nn.Module, optimizers: Sequence[Optimizer], *, strict: bool
) -> None:
    """Loads a single-file Lightning checkpoint (from DDP, one device, or ``state_dict_type="full"``)."""
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, checkpoint["state_dict"], options=options)
    for opt, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
        set_optimizer_state_dict(model, opt, _indices_to_names(state, _parameter_names(model, opt)), options=options)


def _parameter_names(model: nn.Module, optimizer: Optimizer) -> list[str]:
    """Names of the optimizer's parameters in the order Lightning numbers them (group by group)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _names_to_indices(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]],
    }


def _indices_to_names(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    def name(key: int | str) -> str:
        return names[key] if isinstance(key, int) else key

    return {
        "state": {name(key): value for key, value in state["state"].items()},
        "param_groups": [{**g, "params": [name(p) for p in g["params"]]} for g in state["param_groups"]],
    }
