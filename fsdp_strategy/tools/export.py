"""A checkpoint's model weights as Hugging Face safetensors, streamed one shard of one tensor at a time.

:func:`export_safetensors` reads a sharded checkpoint (a directory or a URL) or a single-file Lightning
checkpoint in one process, without a process group, and writes what ``save_pretrained`` writes:
``model.safetensors``, or above ``max_shard_size`` the files ``model-00001-of-0000N.safetensors`` with
``model.safetensors.index.json`` (split exactly as ``save_pretrained`` splits, with ``huggingface_hub``'s
own splitter), plus ``config.json`` when a config is known, so that ``AutoModel*.from_pretrained(out_dir)``
loads it.

Streaming: a safetensors file is a JSON header (names, dtypes, shapes, byte ranges) followed by the raw
tensor bytes. The header is known from DCP's metadata before any tensor is read, so it is written first,
then each tensor's bytes in order: FSDP saves a tensor as row blocks (one per rank), which are read one at
a time from the shard files (``torch.load`` of that byte range, straight from the file) and appended, so the
process holds one row block at a time, never the model and not even a whole tensor. A tensor saved in other
blocks (not whole rows) is read whole through DCP. The ``safetensors`` library then opens every written file
to check its header.
"""

from __future__ import annotations

import io
import json
import math
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from fsdp_strategy.checkpoint import storage
from fsdp_strategy.checkpoint.errors import damaged
from fsdp_strategy.checkpoint.io import MODEL_KEY
from fsdp_strategy.checkpoint.reader import OpenedCheckpoint, open_checkpoint
from fsdp_strategy.sizes import format_bytes, parse_bytes
from fsdp_strategy.tools.progress import progress_bar

__all__ = ["export_safetensors"]

SAFETENSORS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class _Entry:
    """One tensor to export: its name in the output, dtype, shape, and how to get its bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    blocks: Callable[[], Iterator[torch.Tensor]]  # the tensor's bytes as contiguous tensors, in order

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_safetensors` wrote (the ``consolidate`` command prints it)."""

    path: Path
    files: list[str]
    tensors: int
    tensor_bytes: int
    left_out: int
    config: str | None

    def describe(self) -> str:
        config = f"config.json from {self.config}" if self.config else "no config.json (pass --config-from)"
        left = f", {self.left_out} entries outside the prefix left out" if self.left_out else ""
        return (
            f"{self.path}: {self.tensors} tensors, {format_bytes(self.tensor_bytes)} in {len(self.files)} safetensors"
            f" file{'s' if len(self.files) != 1 else ''}{left}; {config}"
        )


def export_safetensors(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    prefix: str = "",
    max_shard_size: int | str = "5GB",
    config_from: Any = None,
    overwrite: bool = False,
    progress: bool = True,
    weights_only: bool = True,
) -> ExportSummary:
    """Writes the model weights of ``checkpoint`` to ``out_dir`` as ``save_pretrained`` does (safetensors).

    Args:
        checkpoint: a sharded checkpoint (directory or URL) or a single-file Lightning checkpoint.
        out_dir: the folder to write; created if needed.
        prefix: keep only the weights under this LightningModule attribute and strip it, e.g. ``"model."``
            for ``self.model = AutoModelForCausalLM...``; ``""`` keeps every weight under its own name.
        max_shard_size: above it the weights are split into several files and an index, as ``save_pretrained``
            splits them (``"5GB"``, ``"500MB"``, ``"1GiB"`` or bytes).
        config_from: the model's config, written as ``config.json`` beside the weights: a
            ``transformers.PretrainedConfig``, a dict, a ``config.json`` file or a folder holding one. ``None``
            looks in the checkpoint's hyper-parameters for a ``PretrainedConfig`` or a config dict (one with
            ``model_type``) and writes none if there is none.
        overwrite: replace weights, index and config already in ``out_dir`` (otherwise that is an error).
        progress: a progress bar over the tensors on stderr (with ``tqdm``).
        weights_only: as for :func:`~fsdp_strategy.consolidate_checkpoint`; only the hyper-parameters are
            unpickled here (to find a config), and the checks of the checkpoint read its pickled entries.

    Raises:
        ValueError: a bad option, a checkpoint that is not one, or no weight under ``prefix``;
            :class:`~fsdp_strategy.CheckpointError` for a damaged one. FileExistsError: files in ``out_dir``.
    """
    limit = parse_bytes(max_shard_size, option="max_shard_size")
    if not isinstance(prefix, str):
        raise TypeError(f"`prefix` must be a str such as 'model.'; got {prefix!r}.")
    opened = open_checkpoint(checkpoint, weights_only=weights_only)
    entries, hyper_parameters, total = _sharded_entries(opened) if opened.sharded else _file_entries(opened)
    kept = [_renamed(entry, entry.name[len(prefix) :]) for entry in entries if entry.name.startswith(prefix)]
    if not kept:
        sample = ", ".join(repr(e.name) for e in entries[:3])
        raise ValueError(f"`prefix` {prefix!r} matches no weight of '{checkpoint}' (its weights start like {sample}).")
    config, config_origin = _config(config_from, hyper_parameters)

    target = Path(out_dir)
    split = _split(kept, limit)
    names = list(split.filename_to_tensors) + ([INDEX_NAME] if split.is_sharded else []) + ([CONFIG_NAME] if config else [])
    _check_output(target, names, overwrite)
    target.mkdir(parents=True, exist_ok=True)
    by_name = {entry.name: entry for entry in kept}
    bar = progress_bar(len(kept), desc="Exporting") if progress else None
    try:
        for filename, tensor_names in split.filename_to_tensors.items():
            _write_file(target / filename, [by_name[name] for name in tensor_names], bar)
    finally:
        if bar is not None:
            bar.close()
    if split.is_sharded:
        totals = {"total_parameters": sum(math.prod(e.shape) for e in kept), "total_size": sum(e.nbytes for e in kept)}
        index = {"metadata": {**split.metadata, **totals}, "weight_map": split.tensor_to_filename}
        _write_atomically(target / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
    if config is not None:
        _write_atomically(target / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True).encode() + b"\n")
    # As save_pretrained cleans the folder: weights of an earlier export left beside these would be loaded
    # instead of them (from_pretrained takes model.safetensors before an index).
    for name in os.listdir(target):
        if _is_weights_file(name) and name not in names:
            (target / name).unlink()
    return ExportSummary(
        target, list(split.filename_to_tensors), len(kept), sum(e.nbytes for e in kept), total - len(kept), config_origin
    )


def _renamed(entry: _Entry, name: str) -> _Entry:
    return _Entry(name, entry.dtype, entry.shape, entry.blocks)


# --- reading ------------------------------------------------------------------------------------------


def _sharded_entries(opened: OpenedCheckpoint) -> tuple[list[_Entry], dict[str, Any], int]:
    """The model's tensors (names without the checkpoint's ``model`` key), the hyper-parameters, and how
    many model entries the checkpoint has (tensors or not)."""
    files, metadata = opened.files, opened.metadata
    hyper_parameters = opened.trainer_state().get("hyper_parameters") or {}
    head = f"{MODEL_KEY}."
    # The model's own order (save_pretrained splits in it): DCP's planner_data keeps the saved state dict's
    # order, while state_dict_metadata lists the keys as the ranks' plans were merged.
    saved_order = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    ordered = [key for key in saved_order if key in metadata.state_dict_metadata]
    ordered += [key for key in metadata.state_dict_metadata if key not in saved_order]
    keys = [key for key in ordered if key.startswith(head)]
    entries = []
    for key in keys:
        md = metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            continue
        rows = _row_blocks(files, metadata, key)
        if rows is not None:
            blocks: Callable[[], Iterator[torch.Tensor]] = lambda rows=rows, md=md: _read_rows(files, rows, md)
        else:
            blocks = lambda key=key: (t for _, t in opened.read_tensors([key]))  # noqa: E731
        entries.append(_Entry(key[len(head) :], md.properties.dtype, tuple(md.size), blocks))
    return entries, _as_dict(hyper_parameters), len(keys)


def _row_blocks(files: storage.CheckpointFiles, metadata: Metadata, key: str) -> list[tuple[Any, ...]] | None:
    """The tensor's saved blocks in row order if they are whole rows that tile it (FSDP's dim-0 shards):
    ``(relative path, offset, length, rows)`` each; else ``None``."""
    md = metadata.state_dict_metadata[key]
    size = tuple(md.size)
    if not size:
        return None
    blocks = []
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if offsets[1:] != (0,) * (len(size) - 1) or sizes[1:] != size[1:]:
            return None
        info = metadata.storage_data.get(MetadataIndex(key, torch.Size(offsets)))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        blocks.append((offsets[0], sizes[0], info.relative_path, info.offset, info.length))
    blocks.sort()
    covered = 0
    for start, rows, *_ in blocks:
        if start != covered:
            return None
        covered += rows
    if covered != size[0]:
        return None
    return [(relative, offset, length, rows) for _, rows, relative, offset, length in blocks]


def _read_rows(files: storage.CheckpointFiles, rows: list[tuple[Any, ...]], md: TensorStorageMetadata) -> Iterator[torch.Tensor]:
    for relative, offset, length, count in rows:
        if count == 0:
            continue
        with files.fs.open(files.path(relative), "rb") as stream:
            # torch.load reads the block's storage straight from the file: one copy in memory, the block's.
            block = torch.load(_Slice(stream, offset, length), map_location="cpu", weights_only=True)
        expected = (count, *tuple(md.size)[1:])
        if not isinstance(block, torch.Tensor) or tuple(block.shape) != expected or block.dtype != md.properties.dtype:
            raise damaged(files.name, relative, f"shard file '{relative}' holds no {expected} block at byte {offset}.")
        yield block
        del block  # before the next block is read: the writer holds this one only while writing it


class _Slice(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of an open file, as a seekable file of their own."""

    def __init__(self, stream: BinaryIO, offset: int, length: int) -> None:
        self._stream, self._offset, self._length, self._position = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, min(self._length, base + position))
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._position)
        if count <= 0:
            return 0
        self._stream.seek(self._offset + self._position)
        # Straight into torch's buffer: a read() would hold a second copy of the block meanwhile.
        read = self._stream.readinto(memoryview(buffer).cast("B")[:count])
        self._position += read or 0
        return read or 0


def _file_entries(opened: OpenedCheckpoint) -> tuple[list[_Entry], dict[str, Any], int]:
    """A single-file Lightning checkpoint (or a plain state dict), memory-mapped when local."""
    source = opened.source
    loaded = opened.load_file()
    state = loaded.get("state_dict") if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict) else loaded
    if not isinstance(state, dict):
        raise ValueError(f"'{source}' is neither a sharded checkpoint nor a checkpoint file with a 'state_dict'.")
    hyper_parameters = loaded.get("hyper_parameters") if state is not loaded else None
    entries = [
        _Entry(name, value.dtype, tuple(value.shape), lambda value=value: iter([value]))
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    ]
    return entries, _as_dict(hyper_parameters or {}), len(state)


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    return dict(vars(value)) if hasattr(value, "__dict__") else {}


# --- the config -----------------------------------------------------------------------------------------


def _config(config_from: Any, hyper_parameters: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The config as a dict for ``config.json``, and where it came from."""
    if config_from is not None:
        return _config_of(config_from), _origin(config_from)
    for key, value in hyper_parameters.items():
        as_dict = _config_dict(value)
        if as_dict is not None:
            return as_dict, f"the hyper-parameter '{key}'"
    return None, None


def _origin(config_from: Any) -> str:
    return f"'{config_from}'" if isinstance(config_from, (str, os.PathLike)) else type(config_from).__name__


def _config_of(config_from: Any) -> dict[str, Any]:
    as_dict = _config_dict(config_from)
    if as_dict is not None:
        return as_dict
    if isinstance(config_from, (str, os.PathLike)):
        path = Path(config_from)
        path = path / CONFIG_NAME if path.is_dir() else path
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"`config_from` '{config_from}' is not a readable config.json ({error}).") from error
        if isinstance(loaded, dict):
            return loaded
    raise ValueError(
        f"`config_from` must be a transformers PretrainedConfig, a dict, a config.json file or a folder holding one;"
        f" got {config_from!r}."
    )


def _config_dict(value: Any) -> dict[str, Any] | None:
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and hasattr(value, "model_type"):  # a transformers PretrainedConfig
        return to_dict()
    if isinstance(value, dict) and isinstance(value.get("model_type"), str):
        return dict(value)
    return None


# --- writing --------------------------------------------------------------------------------------------


def _split(entries: list[_Entry], limit: int) -> Any:
    """The files and their tensors, as ``save_pretrained`` splits a state dict (``huggingface_hub``'s splitter)."""
    try:
        from huggingface_hub import split_state_dict_into_shards_factory
    except ImportError as error:
        raise ImportError("Exporting safetensors needs the 'hf' extra: pip install 'fsdp-strategy[hf]'.") from error
    by_name = {entry.name: entry for entry in entries}
    return split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda entry: entry.nbytes,
        get_storage_id=lambda entry: None,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=limit,
    )


def _check_output(target: Path, names: list[str], overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} is a file; give the folder to write the safetensors files into")
    if overwrite or not target.is_dir():
        return
    taken = sorted(name for name in os.listdir(target) if name in names or _is_weights_file(name))
    if taken:
        raise FileExistsError(f"{target} already holds {', '.join(taken)}; pass overwrite=True (--overwrite) to replace them")


def _is_weights_file(name: str) -> bool:
    return name in (SAFETENSORS_NAME, INDEX_NAME) or (name.startswith("model-") and name.endswith(".safetensors"))


def _header(entries: list[_Entry]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for entry in entries:
        if entry.dtype not in _DTYPES:
            raise ValueError(f"safetensors has no dtype for '{entry.name}' ({entry.dtype}).")
        header[entry.name] = {"dtype": _DTYPES[entry.dtype], "shape": list(entry.shape), "data_offsets": [start, start + entry.nbytes]}
        start += entry.nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # the data that follows starts 8-byte aligned
    return len(data).to_bytes(8, "little") + data


def _write_file(path: Path, entries: list[_Entry], bar: Any) -> None:
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(partial, "xb") as file:
            file.write(_header(entries))
            for entry in entries:
                written = 0
                for block in entry.blocks():
                    block = block.detach().contiguous()
                    data = block.reshape(-1).view(torch.uint8) if block.numel() else block.new_empty(0, dtype=torch.uint8)
                    file.write(memoryview(data.numpy()))
                    written += data.numel()
                    del block, data
                if written != entry.nbytes:
                    raise ValueError(f"'{entry.name}': read {written} bytes, expected {entry.nbytes}.")
                if bar is not None:
                    bar.update()
            file.flush()
            os.fsync(file.fileno())
        _check_written(partial, entries)
        os.replace(partial, path)
    finally:
        if partial.exists():
            partial.unlink()


def _check_written(path: Path, entries: list[_Entry]) -> None:
    """Opens the file with the ``safetensors`` library, which checks the header against the file."""
    try:
        from safetensors import safe_open
    except ImportError:  # the format is checked by whoever loads it
        return
    with safe_open(str(path), framework="pt") as opened:
        names = set(opened.keys())
    if names != {entry.name for entry in entries}:
        raise ValueError(f"{path}: safetensors reads back other tensors than were written.")


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)
