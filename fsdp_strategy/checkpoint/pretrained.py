"""Pretrained Hugging Face weights (what ``save_pretrained`` writes, and what a hub download is) read into a
sharded module, each rank reading from the safetensors files only the rows of its own shards.

A weights directory holds ``model.safetensors``, or ``model.safetensors.index.json`` and the files its
``weight_map`` names. safetensors files open lazily: a header of names, shapes and dtypes, then the raw
tensors, so :func:`read_headers` reads no tensor data and :func:`load_pretrained` reads, per parameter, only
the region of the file this rank's shard holds (``get_slice(...)[start:stop]``), cast to the parameter's dtype.

Names: a LightningModule holds the Hugging Face model as an attribute (``self.model = LlamaForCausalLM(...)``),
so the module's names are the file's keys behind a prefix (``model.``; under peft ``model.base_model.model.``).
The prefix is the one after which the most file keys name a parameter of the module; peft's wrapped layers
(``q_proj.base_layer.weight``) match the file's ``q_proj.weight``. A parameter tied to another
(``lm_head.weight`` to the embedding, left out of the file) is loaded through the name the file has.
Strict loading (the LightningModule's ``strict_loading``, as Lightning loads a checkpoint) refuses a file key the
module lacks and a parameter under the prefix the file lacks; the adapters peft adds beside a ``base_layer``
and parameters outside the prefix (a new head beside the pretrained model) keep their initialization. A shape
that differs is always refused. Buffers (a rotary ``inv_freq``) are left as built unless the file holds them.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp_strategy._compat import strided_shard_dim

__all__ = [
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "TensorHeader",
    "is_weights_directory",
    "load_pretrained",
    "local_region",
    "placed_region",
    "read_headers",
    "weight_files",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_WRAPPED = "base_layer"  # peft's tuner layers keep the pretrained layer under this name

# safetensors' dtype names (the header's "dtype" field).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class TensorHeader:
    """One tensor of a weights directory as its file's header describes it."""

    file: str  # the file's name in the directory
    shape: tuple[int, ...]
    dtype: torch.dtype


def is_weights_directory(path: Any) -> bool:
    """``path`` is a local directory (``init_weights`` then means Hugging Face weights, not a file)."""
    return isinstance(path, (str, Path)) and Path(path).is_dir()


def weight_files(directory: Path | str) -> dict[str, str]:
    """Each tensor name of the directory's weights and the file that holds it (headers are not opened).

    Raises:
        ValueError: the directory holds neither file, or its index is not a ``save_pretrained`` index.
    """
    directory = Path(directory)
    if (directory / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("'weight_map' is not a {name: file} object")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"Hugging Face weights '{directory}': '{INDEX_NAME}' is not a safetensors index ({exc})."
            ) from exc
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise ValueError(
                f"Hugging Face weights '{directory}': '{INDEX_NAME}' names files that are not there: {missing}."
            )
        return dict(weight_map)
    if (directory / WEIGHTS_NAME).is_file():
        return {name: WEIGHTS_NAME for name in _open(directory / WEIGHTS_NAME, directory).keys()}
    raise ValueError(
        f"Hugging Face weights '{directory}' hold neither '{WEIGHTS_NAME}' nor '{INDEX_NAME}'"
        " (what `save_pretrained` writes)."
    )


def read_headers(directory: Path | str) -> dict[str, TensorHeader]:
    """Every tensor's file, shape and dtype, from the files' headers alone (no tensor data is read)."""
    files = weight_files(directory)
    headers: dict[str, TensorHeader] = {}
    for file in sorted(set(files.values())):
        handle = _open(Path(directory) / file, directory)
        present = set(handle.keys())
        listed = [name for name, owner in files.items() if owner == file]
        absent = [name for name in listed if name not in present]
        if absent:
            raise ValueError(
                f"Hugging Face weights '{directory}': '{INDEX_NAME}' places {absent[:5]} in '{file}', which does not"
                " hold them."
            )
        for name in listed:
            view = handle.get_slice(name)
            dtype = _DTYPES.get(view.get_dtype())
            if dtype is None:
                raise ValueError(
                    f"Hugging Face weights '{directory}': '{name}' in '{file}' has dtype {view.get_dtype()}, which"
                    f" torch cannot hold; accepted: {', '.join(_DTYPES)}."
                )
            headers[name] = TensorHeader(file, tuple(view.get_shape()), dtype)
    return headers


def local_region(tensor: Tensor) -> tuple[slice, ...]:
    """The region of the whole tensor that this rank holds of ``tensor``: all of a plain tensor; for a
    DTensor, each ``Shard(dim)`` of its placements cuts ``dim`` as ``torch.chunk`` does (FSDP2's uneven
    shards: ``ceil(n / shards)`` rows per rank, the last ranks fewer or none). Under tensor parallelism a
    colwise weight is ``(_StridedShard(0), Shard(0))``: FSDP2 cut the tensor-parallel piece, so the plain shards
    cut first and the strided one within what they left; the region stays one block."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, size) for size in tensor.shape)
    return placed_region(tensor.shape, tensor.device_mesh, tensor.placements)


def placed_region(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[slice, ...]:
    """:func:`local_region` of a DTensor of ``shape`` placed on ``mesh`` as ``placements``."""
    shape = list(shape)
    starts = [0] * len(shape)
    plain, strided = [], []
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Shard:
            plain.append((mesh_dim, placement.dim))
        elif strided_shard_dim(placement) is not None:
            strided.append((mesh_dim, strided_shard_dim(placement)))
        elif type(placement) is not Replicate:  # a pending reduction
            raise ValueError(
                f"Pretrained weights are read into Shard or Replicate placements; got {placement} in"
                f" {tuple(placements)}."
            )
    for mesh_dim, dim in plain + strided:
        shards = mesh.size(mesh_dim)
        chunk = math.ceil(shape[dim] / shards) if shape[dim] else 0
        start = min(mesh.get_local_rank(mesh_dim) * chunk, shape[dim])
        starts[dim] += start
        shape[dim] = min(chunk, shape[dim] - start)
    return tuple(slice(start, start + size) for start, size in zip(starts, shape))


def load_pretrained(model: nn.Module, directory: Path | str, *, strict: bool) -> None:
    """Fills ``model``'s parameters (and any buffer the files hold) from a Hugging Face weights directory,
    each rank reading only the region of each tensor that its shards hold (see the module docstring).

    Every rank checks the names and shapes from the headers before any tensor data is read.

    Raises:
        ValueError: the directory is not Hugging Face weights; a key is missing, extra (``strict``) or of another
            shape; a tensor is held in a placement other than ``Shard``/``Replicate``.
    """
    headers = read_headers(directory)
    plan = _match(model, headers, directory, strict=strict)
    with torch.no_grad():
        for key, target in sorted(plan.items(), key=lambda item: (headers[item[0]].file, item[0])):
            # A handle per tensor: the pages of the file's memory map that this rank's rows touched count in its
            # resident memory until the map is closed, so one per file would hold this rank's part of a whole file.
            handle = _open(Path(directory) / headers[key].file, directory)
            region = local_region(target)
            values = handle.get_slice(key)[region] if region else handle.get_tensor(key)
            del handle
            local = target.to_local() if isinstance(target, DTensor) else target
            local.copy_(values.to(local.dtype))
            del values


def _open(path: Path, directory: Path | str) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ValueError(
            f"Reading Hugging Face weights ('{directory}') needs the `safetensors` package: pip install"
            " 'fsdp-strategy[hf]'."
        ) from exc
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type for a header it cannot parse
        raise ValueError(
            f"Hugging Face weights '{directory}': '{path.name}' is not a readable safetensors file ({exc})."
        ) from exc


def _normalized(name: str) -> str:
    """``name`` as the file would hold it: peft's ``q_proj.base_layer.weight`` is ``q_proj.weight``."""
    return ".".join(part for part in name.split(".") if part != _WRAPPED)


def _match(
    model: nn.Module, headers: dict[str, TensorHeader], directory: Path | str, *, strict: bool
) -> dict[str, Tensor]:
    """Each file key and the module's tensor it fills, checked as the module docstring says."""
    tensors: dict[str, Tensor] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        tensors.setdefault(_normalized(name), tensor)
    prefix = _prefix(list(headers), tensors, directory)
    plan = {key: tensors[prefix + key] for key in headers if prefix + key in tensors}
    where = f"Hugging Face weights '{directory}'"
    for key, tensor in plan.items():
        if tuple(tensor.shape) != headers[key].shape:
            raise ValueError(
                f"{where}: '{key}' in '{headers[key].file}' has shape {headers[key].shape}, but the module's"
                f" '{prefix + key}' has shape {tuple(tensor.shape)}."
            )
    if strict:
        extra = [key for key in headers if key not in plan]
        if extra:
            raise ValueError(
                f"{where}: {len(extra)} tensor(s) the module has no parameter for (looked for them under"
                f" '{prefix}'): {_listed(extra, headers)}. Set `self.strict_loading = False` in the LightningModule"
                " to leave them out."
            )
        loaded = {id(t) for t in plan.values()}
        wrappers = tuple(name + "." for name, module in model.named_modules() if hasattr(module, _WRAPPED))
        missing = [
            name
            for name, param in model.named_parameters()
            if _normalized(name).startswith(prefix) and id(param) not in loaded and not _is_adapter(name, wrappers)
        ]
        if missing:
            raise ValueError(
                f"{where}: {len(missing)} parameter(s) of the module are not in the weights: {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''} (their file keys would be"
                f" {[_normalized(n)[len(prefix) :] for n in missing[:3]]}). Set `self.strict_loading = False` in the"
                " LightningModule to keep their initialization."
            )
    return plan


def _prefix(keys: list[str], tensors: dict[str, Tensor], directory: Path | str) -> str:
    """The prefix of the module's names behind which the most file keys name one of its tensors."""
    key_set = set(keys)
    counts: Counter[str] = Counter()
    for name in tensors:
        parts = name.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in key_set:
                counts[".".join(parts[:i]) + "." if i else ""] += 1
    if not counts:
        raise ValueError(
            f"Hugging Face weights '{directory}': none of its {len(keys)} tensors ({keys[:3]} ...) is a parameter"
            f" of the module, under any prefix (the module's: {list(tensors)[:3]} ...)."
        )
    ranked = counts.most_common()
    best = [prefix for prefix, count in ranked if count == ranked[0][1]]
    if len(best) > 1:
        raise ValueError(
            f"Hugging Face weights '{directory}': its tensors match the module's parameters under several prefixes"
            f" equally well: {best}. Hold the pretrained model in one attribute of the LightningModule."
        )
    return best[0]


def _is_adapter(name: str, wrappers: tuple[str, ...]) -> bool:
    """A parameter peft added beside a wrapped pretrained layer (``q_proj.lora_A.default.weight`` beside
    ``q_proj.base_layer``); ``wrappers`` are the names (with a dot) of the modules that wrap one."""
    return any(name.startswith(w) and not name.startswith(w + _WRAPPED + ".") for w in wrappers)


def _listed(keys: list[str], headers: dict[str, TensorHeader]) -> str:
    shown = ", ".join(f"'{key}' ({headers[key].file}, {headers[key].shape})" for key in keys[:10])
    return shown + (" ..." if len(keys) > 10 else "")
