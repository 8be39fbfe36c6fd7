"""Turn a sharded checkpoint directory into one ordinary Lightning checkpoint file, in one process.

``FSDP2Strategy`` saves a directory in PyTorch's Distributed Checkpoint (DCP) format: ``.metadata``,
one ``__{rank}_0.distcp`` file per rank, and ``meta.pt`` with the rest of the Lightning checkpoint.
:func:`consolidate_checkpoint` reads that directory without any process group and writes a single
``torch.save`` file that ``LightningModule.load_from_checkpoint`` and ``Trainer.fit(ckpt_path=...)``
accept with any strategy:

* ``state_dict``: plain tensors under the LightningModule's own ``state_dict()`` keys;
* ``optimizer_states``: one entry per optimizer, keyed by parameter index exactly as
  ``torch.optim.Optimizer.state_dict()`` keys it (indices numbered group by group, in order);
* every entry of ``meta.pt`` (epoch, global_step, loops, callbacks, lr_schedulers, hyper-parameters, ...),
  as the objects ``meta.pt`` holds: a dataclass or enum hyper-parameter is written as that object, as
  in DDP's checkpoint file, so ``load_from_checkpoint`` gives what it gives for DDP's file.

Tensors are read one at a time, each whole (all of its shards) straight into the tensor that is kept,
so the process holds what it has collected so far plus a single tensor in flight: about one copy of
the model and optimizer state, never two.

Like loading in the strategy, nothing runs code stored in the checkpoint unless ``weights_only=False``
says it is trusted: the directory is first checked by
:func:`fsdp_strategy.checkpoint.verify.verify_sharded_checkpoint`, ``.metadata`` is read with its restricted
unpickler, and the non-tensor entries and ``meta.pt`` with ``torch.load(weights_only=True)``, which
refuses types that are neither registered with ``torch.serialization.add_safe_globals`` nor in
:data:`fsdp_strategy.checkpoint.trainer_state.ACCEPTED_TYPES`. The file written then needs the same to load as DDP's
file does: nothing more than plain data loads with ``torch.load(weights_only=True)``, and other types
need ``load_from_checkpoint(..., weights_only=False)`` or ``add_safe_globals``.
"""

from __future__ import annotations

import os
import uuid
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from fsdp_strategy.checkpoint.layout import optimizer_key, sharded_parts
from fsdp_strategy.checkpoint.reader import open_checkpoint
from fsdp_strategy.sizes import format_bytes
from fsdp_strategy.tools.export import export_safetensors
from fsdp_strategy.tools.export_peft import export_peft
from fsdp_strategy.tools.progress import progress_bar

__all__ = ["ConsolidatedFile", "consolidate_checkpoint", "consolidate_to_file"]


@dataclass(frozen=True)
class ConsolidatedFile:
    """What :func:`consolidate_checkpoint` wrote (the ``consolidate`` command prints it)."""

    path: Path
    tensors: int
    tensor_bytes: int
    file_bytes: int

    def describe(self) -> str:
        data, file = format_bytes(self.tensor_bytes), format_bytes(self.file_bytes)
        return f"{self.path}: {self.tensors} tensors, {data} of tensor data, file {file}"


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = True,
    weights_only: bool = True,
    format: str = "lightning",
    prefix: str | None = None,
    max_shard_size: int | str | None = None,
    config_from: Any = None,
) -> Path:
    """Writes the sharded checkpoint ``checkpoint_dir`` as one Lightning checkpoint file ``output_file``.

    With ``format="safetensors"``, ``output_file`` is a folder that receives the model's weights as
    ``save_pretrained`` writes them, for ``from_pretrained``: see :func:`fsdp_strategy.tools.export.export_safetensors`
    for ``prefix``, ``max_shard_size`` and ``config_from`` (options of that format only). With ``format="peft"``,
    ``output_file`` is a folder that receives a ``peft`` run's adapters as ``PeftModel.save_pretrained`` writes them
    (:func:`fsdp_strategy.tools.export_peft.export_peft`; ``prefix``: the attribute of the peft model).

    Runs in one process and needs no process group. The file is written under a temporary name in the
    same folder and renamed when complete, so a failure never leaves a partial ``output_file``.

    Args:
        checkpoint_dir: a directory written by ``FSDP2Strategy`` (``state_dict_type="sharded"``).
        output_file: the file to write; its folder is created if needed.
        overwrite: replace ``output_file`` if it exists (otherwise that is an error).
        progress: show a progress bar over the tensors on stderr (needs ``tqdm``; none without it).
        weights_only: ``True``: the pickled objects (``meta.pt``, non-tensor entries) are read with
            ``torch.load(weights_only=True)``, which runs no code from the checkpoint and refuses types
            that are not registered with ``torch.serialization.add_safe_globals`` (hyper-parameters that
            are your own dataclasses or enums, OmegaConf configs). ``False``: trust the checkpoint and
            read them whatever they are, as ``load_from_checkpoint(..., weights_only=False)`` does.

    Returns:
        The path of the written file.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` does not exist.
        ValueError: ``checkpoint_dir`` is not a sharded checkpoint (not a directory, no ``.metadata`` or
            no ``meta.pt``); or :class:`fsdp_strategy.CheckpointError` (a ``ValueError``): it is
            damaged (a missing or truncated shard file, unreadable contents) or, with ``weights_only=True``,
            holds objects of types that are not allowed (the message names them and both fixes).
        FileExistsError: ``output_file`` exists and ``overwrite`` is false.
        IsADirectoryError: ``output_file`` is a directory.
    """
    if format == "safetensors":
        return export_safetensors(
            checkpoint_dir,
            output_file,
            prefix=prefix or "",
            max_shard_size="5GB" if max_shard_size is None else max_shard_size,
            config_from=config_from,
            overwrite=overwrite,
            progress=progress,
            weights_only=weights_only,
        ).path
    if format == "peft":
        for option, value in (("max_shard_size", max_shard_size), ("config_from", config_from)):
            if value is not None:
                raise ValueError(f"`{option}` is an option of format='safetensors'; got {value!r} with format='peft'.")
        return export_peft(
            checkpoint_dir,
            output_file,
            prefix=prefix,
            overwrite=overwrite,
            progress=progress,
            weights_only=weights_only,
        ).path
    if format != "lightning":
        raise ValueError(
            f"`format` must be 'lightning' (one checkpoint file), 'safetensors' or 'peft'; got {format!r}."
        )
    for option, value in (("prefix", prefix), ("max_shard_size", max_shard_size), ("config_from", config_from)):
        if value is not None:
            raise ValueError(f"`{option}` is an option of format='safetensors'; got {value!r} with format='lightning'.")
    return consolidate_to_file(
        checkpoint_dir, output_file, overwrite=overwrite, progress=progress, weights_only=weights_only
    ).path


def consolidate_to_file(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = True,
    weights_only: bool = True,
) -> ConsolidatedFile:
    """:func:`consolidate_checkpoint`, returning what was written (for the ``consolidate`` command)."""
    target = Path(output_file)
    opened = open_checkpoint(checkpoint_dir, weights_only=weights_only, sharded_only=True)
    source, metadata = opened.source, opened.metadata
    _check_output(target, overwrite)
    trainer_state = opened.trainer_state()

    tensor_keys = opened.tensor_keys()
    tensor_set = set(tensor_keys)
    other_keys = [key for key in metadata.state_dict_metadata if key not in tensor_set]
    flat: dict[str, Any] = opened.read_non_tensors(other_keys)
    tensor_bytes = 0
    # Largest first: the memory a read needs besides its result (a shard's buffer) is then largest while
    # little has been collected yet, and the peak stays close to the sum of the results.
    read_order = sorted(tensor_keys, key=lambda key: -opened.tensor_bytes(key))
    bar = progress_bar(len(tensor_keys), desc="Consolidating") if progress else None
    try:
        for key, tensor in opened.read_tensors(read_order):
            flat[key] = tensor
            tensor_bytes += tensor.numel() * tensor.element_size()
            if bar is not None:
                bar.update()
    finally:
        if bar is not None:
            bar.close()  # ends its line, also on an error, so that the error message gets a line of its own
    # Metadata order is the order in which the state was saved; keep it for the nested dicts.
    flat = {key: flat[key] for key in metadata.state_dict_metadata}

    checkpoint = _lightning_checkpoint(_unflatten(flat, metadata), trainer_state, source)
    del flat
    _save_atomically(checkpoint, target, overwrite)
    return ConsolidatedFile(target, len(tensor_keys), tensor_bytes, target.stat().st_size)


# --- building the Lightning checkpoint ------------------------------------------------------------------


def _unflatten(flat: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """Rebuilds the nested state from DCP's flat keys; ``planner_data`` holds each key's path (ints index lists)."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        path = paths.get(key) or (key,)
        node: Any = nested
        for part, next_part in zip(path[:-1], path[1:]):
            child = _get(node, part)
            if child is None:
                child = [] if isinstance(next_part, int) else {}
                _put(node, part, child)
            node = child
        _put(node, path[-1], value)
    return nested


def _get(node: Any, key: Any) -> Any:
    if isinstance(node, list):
        return node[key] if key < len(node) else None
    return node.get(key)


def _put(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
    node[key] = value


def _lightning_checkpoint(nested: dict[str, Any], trainer_state: dict[str, Any], source: Path) -> dict[str, Any]:
    model, optimizers, others = sharded_parts(nested)  # others: not written by FSDP2Strategy; kept under their keys
    if sorted(optimizers) != list(range(len(optimizers))):
        numbers = sorted(optimizers)
        raise ValueError(f"cannot consolidate {source}: optimizer entries are not numbered 0..N-1: {numbers}")
    checkpoint = {**trainer_state, **others}
    checkpoint["state_dict"] = {} if model is None else model
    checkpoint["optimizer_states"] = [
        _index_keyed(optimizers[i], optimizer_key(i), source) for i in range(len(optimizers))
    ]
    return checkpoint


def _index_keyed(state: dict[str, Any], name: str, source: Path) -> dict[str, Any]:
    """Parameter names to the indices that ``Optimizer.state_dict()`` uses: positions in the groups, group by group."""
    groups = state.get("param_groups", [])
    names = [param for group in groups for param in group["params"]]
    index = {param: i for i, param in enumerate(names)}
    if len(index) != len(names):
        raise ValueError(f"cannot consolidate {source}: {name} lists a parameter more than once in its param_groups")
    per_param = state.get("state", {})  # DCP saves nothing for an optimizer that has not stepped yet
    unknown = [param for param in per_param if param not in index]
    if unknown:
        shown = ", ".join(repr(param) for param in unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise ValueError(f"cannot consolidate {source}: {name} has state for parameters in no param group: {shown}")
    return {
        "state": {index[param]: per_param[param] for param in names if param in per_param},
        "param_groups": [{**group, "params": [index[param] for param in group["params"]]} for group in groups],
    }


# --- writing ---------------------------------------------------------------------------------------------


def _check_output(target: Path, overwrite: bool) -> None:
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a directory; give the path of the checkpoint file to write")
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True (--overwrite) to replace it")


def _save_atomically(checkpoint: dict[str, Any], target: Path, overwrite: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(partial, "xb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        _check_output(target, overwrite)  # it may have appeared while we were reading
        os.replace(partial, target)
    finally:
        with suppress(FileNotFoundError):
            partial.unlink()
