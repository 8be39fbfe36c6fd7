"""The state dicts of a sharded model in and out of checkpoints: taken for a save, sharded or full, and read back
into the module and its optimizers.

Which parts a checkpoint dict has is :mod:`~fsdp_strategy.checkpoint.layout`'s; writing the files and putting
them in place, :mod:`~fsdp_strategy.checkpoint.writing`'s; the formats that combine them,
:mod:`~fsdp_strategy.checkpoint.formats`'.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fsdp_strategy.checkpoint import optimizer_state as optimizer_state_io
from fsdp_strategy.checkpoint import storage
from fsdp_strategy.checkpoint.dcp_metadata import read_dcp_metadata
from fsdp_strategy.checkpoint.errors import CheckpointError, damaged, refused
from fsdp_strategy.checkpoint.layout import MODEL_KEY, optimizer_key, optimizer_number
from fsdp_strategy.checkpoint.location import location_of
from fsdp_strategy.checkpoint.trainer_state import load_trainer_state
from fsdp_strategy.checkpoint.verify import (
    check_model_matches,
    compare_keys,
    state_dict_shapes,
)

__all__ = [
    "check_full_state_dict",
    "load_full_optimizers",
    "load_checkpoint_file",
    "load_full_weights",
    "load_sharded_model",
    "load_sharded_optimizers",
    "read_full_checkpoint",
    "read_full_weights",
    "read_sharded",
    "require_state_dict",
    "model_state",
    "optimizer_state",
]


def model_state(model: nn.Module, *, full: bool) -> dict[str, Any]:
    """Sharded: this rank's DTensor shards. Full: whole tensors on CPU on rank 0, empty elsewhere."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def optimizer_state(model: nn.Module, optimizer: Optimizer, *, full: bool, keep: bool = True) -> dict[str, Any]:
    """Sharded: keyed by parameter names, this rank's shards. Full: keyed by parameter index, as Lightning's, whole
    tensors on CPU where ``keep`` (rank 0), empty elsewhere. The optimizer is only read (see :mod:`.optimizer_state`)."""
    if full:
        return optimizer_state_io.full_state(optimizer, keep=keep)
    return optimizer_state_io.sharded_state(model, optimizer)


def read_sharded(
    path: Path | str | storage.CheckpointFiles,
    model: nn.Module,
    *,
    strict: bool,
    weights_only: bool = True,
    whole: bool = True,
    leave_out: Collection[str] = (),
) -> dict[str, Any]:
    """The trainer state of a sharded checkpoint, and with ``whole`` its model-shaped entries too, as a single-file
    checkpoint holds them: the module's under ``"state_dict"``, loaded in place into ``model``'s own tensors (its
    shards, once sharded), and any other entry saved in shards (WeightAveraging's ``"current_model_state"``) under
    its name, in new tensors laid out as the module's. Optimizer states stay in the files
    (:func:`load_sharded_optimizers`).

    Call :func:`fsdp_strategy.checkpoint.verify.verify_sharded_checkpoint` first (with the same ``weights_only``):
    DCP itself unpickles its metadata and non-tensor entries without restrictions. ``path`` may be a URL
    (its manifest is followed) or the :class:`~fsdp_strategy.checkpoint.storage.CheckpointFiles` of one.
    ``leave_out``: entries of the module's state that the checkpoint does not hold (an adapter checkpoint's frozen
    parameters), which keep their values.
    """
    files = storage.checkpoint_files(path)
    metadata = read_dcp_metadata(files)
    trainer_state = load_trainer_state(files, weights_only=weights_only)
    read = lambda flat: dcp.load(flat, storage_reader=files.reader())  # noqa: E731
    param_groups = optimizer_state_io.read_param_groups(metadata, read)
    if param_groups:  # the tensors follow once the sharded optimizers exist (load_sharded_optimizers)
        trainer_state["optimizer_states"] = [{"state": {}, "param_groups": groups} for groups in param_groups]
    if not whole:
        return trainer_state
    own = _without(_state_dict(model), leave_out)
    check_model_matches(files, own, strict=strict, metadata=metadata)
    saved = set(metadata.state_dict_metadata)
    tensors: dict[str, Any] = {MODEL_KEY: {k: v for k, v in own.items() if f"{MODEL_KEY}.{k}" in saved}}
    for key in _model_shaped_entries(metadata):
        tensors[key] = {k: torch.empty_like(v) for k, v in own.items() if f"{key}.{k}" in saved}
    dcp.load(tensors, storage_reader=files.reader())
    loaded = {"state_dict": tensors.pop(MODEL_KEY)}
    return {**trainer_state, **loaded, **tensors}


def _state_dict(model: nn.Module) -> dict[str, Any]:
    # A sharded module's entries are its DTensor shards; DCP loads into either in place. nn.Module's own method, not
    # an override of the user's: a template is no call of the module's `state_dict` hook, which DDP never makes here.
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return get_model_state_dict(model)
    return nn.Module.state_dict(model)


def _model_shaped_entries(metadata: Any) -> list[str]:
    """Top-level entries of a sharded checkpoint besides the module's and the optimizers' (saved in shards because
    they held DTensors: a callback's copy of the module's state)."""
    keys = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    return sorted(key for key in keys if key != MODEL_KEY and optimizer_number(key) is None)


def _without(state: dict[str, Any], leave_out: Collection[str]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in leave_out} if leave_out else state


def load_sharded_model(
    path: Path | str | storage.CheckpointFiles, model: nn.Module, *, strict: bool, leave_out: Collection[str] = ()
) -> None:
    """Loads the module's shards of a sharded checkpoint into the sharded ``model`` (each rank reads its own);
    the entries in ``leave_out`` (see :func:`read_sharded`) keep their values."""
    files = storage.checkpoint_files(path)
    state = _without(get_model_state_dict(model), leave_out)
    check_model_matches(files, state, strict=strict)
    saved = set(read_dcp_metadata(files).state_dict_metadata)
    tensors = {MODEL_KEY: {k: v for k, v in state.items() if f"{MODEL_KEY}.{k}" in saved}}
    dcp.load(tensors, storage_reader=files.reader())
    # The keys were checked above, those left out apart: torch's strict check would count those as missing.
    set_model_state_dict(model, tensors[MODEL_KEY], options=StateDictOptions(strict=strict and not leave_out))


def load_sharded_optimizers(
    path: Path | str | storage.CheckpointFiles,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    saved: Sequence[dict[str, Any]],
) -> None:
    """Loads each optimizer's state entries (``optimizer_<i>.state`` in the checkpoint, this rank's shards) into the
    optimizers of the sharded ``model``, with the ``param_groups`` of ``saved`` (the ``"optimizer_states"`` that
    :func:`read_sharded` returned, as ``on_load_checkpoint`` left them), as ``optimizer.load_state_dict`` does for
    DDP: the optimizers are not stepped."""
    files = storage.checkpoint_files(path)
    metadata = read_dcp_metadata(files)
    pairs = list(zip(optimizers, saved))
    flat: dict[str, Any] = {}
    for i, (opt, _) in enumerate(pairs):
        flat.update(optimizer_state_io.load_sharded_template(metadata, f"{optimizer_key(i)}.", model, opt))
    if flat:
        dcp.load(flat, storage_reader=files.reader())
    for i, (opt, state) in enumerate(pairs):
        prefix = f"{optimizer_key(i)}."
        entries = {k: v for k, v in flat.items() if k.startswith(prefix)}
        opt.load_state_dict(optimizer_state_io.unflatten(entries, state["param_groups"], prefix, model, opt))


def read_full_checkpoint(path: Path | str, *, weights_only: bool | None) -> dict[str, Any]:
    """A single-file Lightning checkpoint; a truncated or foreign file raises :class:`~fsdp_strategy.checkpoint.errors.CheckpointError`."""
    return require_state_dict(load_checkpoint_file(path, weights_only=weights_only), path)


def require_state_dict(checkpoint: Any, path: Path | str) -> dict[str, Any]:
    """``checkpoint`` if it is a Lightning checkpoint (a dict with a ``state_dict``); else a named error."""
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise CheckpointError(
            f"Checkpoint '{path}' is not a Lightning checkpoint: '{_file_name(path)}' has no 'state_dict' entry.",
            checkpoint=path,
            file=_file_name(path),
        )
    return checkpoint


def _file_name(path: Path | str) -> str:
    return location_of(path).name


def load_checkpoint_file(path: Path | str, *, weights_only: bool | None) -> Any:
    """``torch.load`` of one checkpoint file (memory-mapped when local), with damaged and untrusted files named."""
    where = location_of(path)
    if not where.is_file():
        raise FileNotFoundError(f"Checkpoint '{path}' does not exist.")
    name = where.name
    try:
        if where.remote:  # no memory map over a network: the file is read whole
            return torch.load(io.BytesIO(where.read_bytes()), map_location="cpu", weights_only=weights_only)
        return torch.load(where.value, map_location="cpu", mmap=True, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        detail = (
            f"'{name}' contains objects that are not plain data, so it was not unpickled. If you trust this"
            " file, pass `trainer.fit(..., weights_only=False)`."
        )
        raise refused(path, name, detail) from exc
    except Exception as exc:
        detail = (
            f"'{name}' is not a complete checkpoint file (truncated, or not written by torch.save):"
            f" {type(exc).__name__}."
        )
        raise damaged(path, name, detail) from exc


def check_full_state_dict(model: nn.Module, state_dict: dict[str, Any], *, strict: bool, path: Path | str) -> None:
    """Raises :class:`~fsdp_strategy.checkpoint.errors.CheckpointError` naming the file when the weights of a
    single-file checkpoint do not fit ``model`` (plain or sharded; global shapes)."""
    compare_keys(
        state_dict_shapes(_state_dict(model)),
        state_dict_shapes(state_dict),
        checkpoint=path,
        strict=strict,
        file=_file_name(path),
    )


def load_full_optimizers(optimizers: Sequence[Optimizer], states: Sequence[dict[str, Any]]) -> None:
    """Loads the full optimizer states of a single-file checkpoint (Lightning's layout) into sharded optimizers."""
    for opt, state in zip(optimizers, states):
        optimizer_state_io.load_full_state(opt, state)


def read_full_weights(path: Path | str) -> dict[str, Any]:
    """The model weights in a full checkpoint file: a Lightning checkpoint's ``state_dict``, or a plain state dict.

    Memory-mapped, so the file is paged in tensor by tensor as it is broadcast, not read whole.
    """
    loaded = load_checkpoint_file(path, weights_only=True)
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(
            f"`init_weights` file '{path}' holds no state dict: expected a Lightning checkpoint with a 'state_dict'"
            " entry or a plain {name: tensor} dict."
        )
    return loaded


def load_full_weights(model: nn.Module, weights: dict[str, Any], *, strict: bool) -> None:
    """Fills a sharded model from full weights held by rank 0 only (``{}`` elsewhere): each rank receives its shards."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, weights, options=options)
