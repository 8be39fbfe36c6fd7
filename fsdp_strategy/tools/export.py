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

import json
import math
import os
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fsdp_strategy.checkpoint.weights import WeightEntry, read_model_weights
from fsdp_strategy.sizes import format_bytes, parse_bytes
from fsdp_strategy.tools.progress import progress_bar

__all__ = ["export_safetensors", "write_atomically", "write_safetensors_file"]

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
    weights = read_model_weights(checkpoint, weights_only=weights_only)
    entries, hyper_parameters, total = weights.entries, weights.hyper_parameters, weights.total
    kept = [replace(entry, name=entry.name[len(prefix) :]) for entry in entries if entry.name.startswith(prefix)]
    if not kept:
        sample = ", ".join(repr(e.name) for e in entries[:3])
        raise ValueError(f"`prefix` {prefix!r} matches no weight of '{checkpoint}' (its weights start like {sample}).")
    config, config_origin = _config(config_from, hyper_parameters)

    target = Path(out_dir)
    split = _split(kept, limit)
    names = (
        list(split.filename_to_tensors) + ([INDEX_NAME] if split.is_sharded else []) + ([CONFIG_NAME] if config else [])
    )
    _check_output(target, names, overwrite)
    target.mkdir(parents=True, exist_ok=True)
    by_name = {entry.name: entry for entry in kept}
    bar = progress_bar(len(kept), desc="Exporting") if progress else None
    try:
        for filename, tensor_names in split.filename_to_tensors.items():
            write_safetensors_file(target / filename, [by_name[name] for name in tensor_names], bar)
    finally:
        if bar is not None:
            bar.close()
    if split.is_sharded:
        totals = {"total_parameters": sum(math.prod(e.shape) for e in kept), "total_size": sum(e.nbytes for e in kept)}
        index = {"metadata": {**split.metadata, **totals}, "weight_map": split.tensor_to_filename}
        write_atomically(target / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
    if config is not None:
        write_atomically(target / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True).encode() + b"\n")
    # As save_pretrained cleans the folder: weights of an earlier export left beside these would be loaded
    # instead of them (from_pretrained takes model.safetensors before an index).
    for name in os.listdir(target):
        if _is_weights_file(name) and name not in names:
            (target / name).unlink()
    return ExportSummary(
        target,
        list(split.filename_to_tensors),
        len(kept),
        sum(e.nbytes for e in kept),
        total - len(kept),
        config_origin,
    )


# --- reading ------------------------------------------------------------------------------------------


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


def _split(entries: list[WeightEntry], limit: int) -> Any:
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
        raise FileExistsError(
            f"{target} already holds {', '.join(taken)}; pass overwrite=True (--overwrite) to replace them"
        )


def _is_weights_file(name: str) -> bool:
    return name in (SAFETENSORS_NAME, INDEX_NAME) or (name.startswith("model-") and name.endswith(".safetensors"))


def _header(entries: list[WeightEntry]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for entry in entries:
        if entry.dtype not in _DTYPES:
            raise ValueError(f"safetensors has no dtype for '{entry.name}' ({entry.dtype}).")
        header[entry.name] = {
            "dtype": _DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [start, start + entry.nbytes],
        }
        start += entry.nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # the data that follows starts 8-byte aligned
    return len(data).to_bytes(8, "little") + data


def write_safetensors_file(path: Path, entries: list[WeightEntry], bar: Any) -> None:
    """One safetensors file of ``entries``, in their order, written aside and renamed into place (``bar``: a
    progress bar, or ``None``)."""
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(partial, "xb") as file:
            file.write(_header(entries))
            for entry in entries:
                written = 0
                for block in entry.blocks():
                    block = block.detach().contiguous()
                    data = (
                        block.reshape(-1).view(torch.uint8) if block.numel() else block.new_empty(0, dtype=torch.uint8)
                    )
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


def _check_written(path: Path, entries: list[WeightEntry]) -> None:
    """Opens the file with the ``safetensors`` library, which checks the header against the file."""
    try:
        from safetensors import safe_open
    except ImportError:  # the format is checked by whoever loads it
        return
    with safe_open(str(path), framework="pt") as opened:
        names = set(opened.keys())
    if names != {entry.name for entry in entries}:
        raise ValueError(f"{path}: safetensors reads back other tensors than were written.")


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` as the file ``path``, written aside and renamed into place."""
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)
