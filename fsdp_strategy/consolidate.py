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
:func:`fsdp_strategy.verify.verify_sharded_checkpoint`, ``.metadata`` is read with its restricted
unpickler, and the non-tensor entries and ``meta.pt`` with ``torch.load(weights_only=True)``, which
refuses types that are neither registered with ``torch.serialization.add_safe_globals`` nor in
:data:`fsdp_strategy.trainer_state.ACCEPTED_TYPES`. The file written then needs the same to load as DDP's
file does: nothing more than plain data loads with ``torch.load(weights_only=True)``, and other types
need ``load_from_checkpoint(..., weights_only=False)`` or ``add_safe_globals``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import sys
import uuid
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from fsdp_strategy import storage
from fsdp_strategy.checkpoint import MODEL_KEY
from fsdp_strategy.dcp_metadata import DCP_METADATA_FILENAME, read_dcp_metadata
from fsdp_strategy.sizes import format_bytes
from fsdp_strategy.trainer_state import TRAINER_STATE_FILENAME, load_trainer_state, torch_load
from fsdp_strategy.verify import verify_sharded_checkpoint

__all__ = ["consolidate_checkpoint"]

_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")


@dataclass(frozen=True)
class _Summary:
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
    ``save_pretrained`` writes them, for ``from_pretrained``: see :func:`fsdp_strategy.export.export_safetensors`
    for ``prefix``, ``max_shard_size`` and ``config_from`` (options of that format only).

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
        from fsdp_strategy.export import export_safetensors

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
    if format != "lightning":
        raise ValueError(f"`format` must be 'lightning' (one checkpoint file) or 'safetensors'; got {format!r}.")
    for option, value in (("prefix", prefix), ("max_shard_size", max_shard_size), ("config_from", config_from)):
        if value is not None:
            raise ValueError(f"`{option}` is an option of format='safetensors'; got {value!r} with format='lightning'.")
    return _consolidate(checkpoint_dir, output_file, overwrite=overwrite, progress=progress, weights_only=weights_only).path


def _consolidate(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = True,
    weights_only: bool = True,
) -> _Summary:
    """:func:`consolidate_checkpoint`, returning what was written (for the ``consolidate`` command)."""
    source, target = storage.location(checkpoint_dir), Path(output_file)
    files, reader, metadata = _open_checkpoint(source, weights_only=weights_only)
    _check_output(target, overwrite)
    trainer_state = load_trainer_state(files, weights_only=weights_only)

    tensor_keys = [key for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)]
    tensor_set = set(tensor_keys)
    other_keys = [key for key in metadata.state_dict_metadata if key not in tensor_set]
    flat: dict[str, Any] = _read_non_tensors(reader, metadata, source, other_keys, weights_only=weights_only)
    tensor_bytes = 0
    # Largest first: the memory a read needs besides its result (a shard's buffer) is then largest while
    # little has been collected yet, and the peak stays close to the sum of the results.
    read_order = sorted(tensor_keys, key=lambda key: -_nbytes(metadata.state_dict_metadata[key]))
    bar = _progress_bar(len(tensor_keys)) if progress else None
    try:
        for key, tensor in _read_tensors(reader, metadata, source, read_order):
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
    return _Summary(target, len(tensor_keys), tensor_bytes, target.stat().st_size)


# --- reading the directory ----------------------------------------------------------------------------


def _open_checkpoint(source: Path | str, *, weights_only: bool) -> tuple[storage.CheckpointFiles, Any, Metadata]:
    if isinstance(source, Path):
        if not source.exists():
            raise FileNotFoundError(f"checkpoint directory {source} does not exist")
        if not source.is_dir():
            raise ValueError(
                f"{source} is not a directory; expected a sharded checkpoint directory (with .metadata and meta.pt)"
            )
    files = storage.checkpoint_files(source)  # a URL: its manifest, read once
    if not files.is_file(DCP_METADATA_FILENAME):
        raise ValueError(
            f"{source} is not a sharded checkpoint: it has no {DCP_METADATA_FILENAME} file"
            " (the Distributed Checkpoint index)"
        )
    if not files.is_file(TRAINER_STATE_FILENAME):
        raise ValueError(
            f"{source} is not a sharded Lightning checkpoint: it has no {TRAINER_STATE_FILENAME} file"
            " (the trainer state)"
        )
    # Shard files present and long enough, non-tensor entries and meta.pt loadable: CheckpointError otherwise.
    verify_sharded_checkpoint(files, weights_only=weights_only)
    metadata = read_dcp_metadata(files)  # not the reader's read_metadata(): that is pickle.load
    reader = files.reader()
    reader.set_up_storage_reader(metadata, True)
    return files, reader, metadata


class _CheckedPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries are read by ``trainer_state.torch_load`` (it uses ``weights_only=False``)."""

    def __init__(self, *, weights_only: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.weights_only = weights_only

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch_load(value, weights_only=self.weights_only)


def _read(
    reader: FileSystemReader, metadata: Metadata, entries: dict[str, Any], *, weights_only: bool = True
) -> dict[str, Any]:
    """One DCP read of ``entries`` (flat keys of the checkpoint): tensors are filled in place, other values replaced."""
    planner = _CheckedPlanner(weights_only=weights_only)
    planner.set_up_planner(entries, metadata, True)
    plans = planner.create_global_plan([reader.prepare_local_plan(planner.create_local_plan())])
    plan = planner.finish_plan(reader.prepare_global_plan(plans)[0])
    reader.read_data(plan, planner).wait()
    return entries


def _read_non_tensors(
    reader: FileSystemReader, metadata: Metadata, source: Path, keys: list[str], *, weights_only: bool
) -> dict[str, Any]:
    """Non-tensor values (optimizer hyper-parameters, parameter names, ...) are small pickles: one read for all."""
    for key in keys:
        if not isinstance(metadata.state_dict_metadata[key], BytesStorageMetadata):
            kind = type(metadata.state_dict_metadata[key]).__name__
            raise ValueError(f"cannot consolidate {source}: entry {key!r} is stored as {kind}, which is not supported")
    if not keys:
        return {}
    try:
        return _read(reader, metadata, dict.fromkeys(keys), weights_only=weights_only)
    except Exception as exc:
        raise ValueError(f"cannot read the non-tensor values of {source}: {_one_line(exc)}") from exc


def _read_tensors(
    reader: FileSystemReader, metadata: Metadata, source: Path, keys: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor whole, one read each: its shards from all ranks' files are copied into one new tensor."""
    for key in keys:
        md = metadata.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata)
        tensor = torch.empty(md.size, dtype=md.properties.dtype)
        try:
            _read(reader, metadata, {key: tensor})
        except MemoryError:
            raise
        except Exception as exc:
            raise ValueError(f"cannot read tensor {key!r} from {source}: {_one_line(exc)}") from exc
        if tensor.numel() * tensor.element_size() >= _TRIM_AFTER_BYTES:
            _release_freed_memory()
        yield key, tensor


# Each read loads the tensor's shards into buffers of their own before copying them into the tensor that
# is kept. glibc serves buffers below its mmap threshold (which grows up to 32 MiB) from the heap, and the
# freed ones stay resident as holes between the tensors kept: 11% of the state on top of it for a
# 100M-parameter model with AdamW saved by 2 ranks, 0.4% with malloc_trim(0), which hands those pages back.
_TRIM_AFTER_BYTES = 2**20


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc only; musl has none
    except (OSError, AttributeError):
        return None


def _release_freed_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _nbytes(md: Any) -> int:
    return math.prod(md.size) * md.properties.dtype.itemsize


def _progress_bar(total: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is an optional dependency: no bar then
        return None
    return tqdm(total=total, desc="Consolidating", unit="tensor", file=sys.stderr, dynamic_ncols=True)


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
    optimizers: dict[int, Any] = {}
    others: dict[str, Any] = {}
    for key, value in nested.items():
        match = _OPTIMIZER_KEY.fullmatch(key)
        if match:
            optimizers[int(match.group(1))] = value
        elif key != MODEL_KEY:
            others[key] = value  # not written by FSDP2Strategy; kept under its own key
    if sorted(optimizers) != list(range(len(optimizers))):
        numbers = sorted(optimizers)
        raise ValueError(f"cannot consolidate {source}: optimizer entries are not numbered 0..N-1: {numbers}")
    checkpoint = {**trainer_state, **others}
    checkpoint["state_dict"] = nested.get(MODEL_KEY, {})
    checkpoint["optimizer_states"] = [
        _index_keyed(optimizers[i], f"optimizer_{i}", source) for i in range(len(optimizers))
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
        shown = ", ".join(repr(param) for param in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
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


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
