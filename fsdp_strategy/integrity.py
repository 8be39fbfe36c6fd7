"""Checks that a sharded checkpoint directory is whole, safe to read and made for this model.

A sharded checkpoint is a Distributed Checkpoint (DCP) directory: DCP's index ``.metadata`` (a pickled
``torch.distributed.checkpoint.metadata.Metadata``), the shard files ``__{rank}_0.distcp`` it points
into, and ``meta.pt`` with Lightning's trainer state (epoch, loops, callbacks, schedulers, ...).

Nothing here runs code stored in a checkpoint:

* ``.metadata`` is read by an unpickler that only builds the classes DCP metadata is made of (DCP's own
  ``dcp.load`` reads it with plain :func:`pickle.load`, which would run whatever the file asks for);
* the non-tensor entries of the shard files (optimizer ``param_groups`` values and the like, which
  DCP's default planner reads with ``torch.load(weights_only=False)``) are first read here with
  ``torch.load(weights_only=True)``;
* ``meta.pt`` is written as plain data and read with ``torch.load(weights_only=True)``.

Every problem is reported as a :class:`CheckpointError` naming the checkpoint directory and the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import io
import os
import pathlib
import pickle
import re
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

__all__ = [
    "DCP_METADATA_FILENAME",
    "TRAINER_STATE_FILENAME",
    "CheckpointError",
    "check_model_matches",
    "compare_keys",
    "is_half_written",
    "load_trainer_state",
    "looks_like_sharded_checkpoint",
    "read_dcp_metadata",
    "save_trainer_state",
    "saved_shapes",
    "state_dict_shapes",
    "to_plain_trainer_state",
    "verify_sharded_checkpoint",
]

DCP_METADATA_FILENAME = ".metadata"
TRAINER_STATE_FILENAME = "meta.pt"  # == fsdp_strategy.checkpoint.METADATA_FILENAME
SHARD_SUFFIX = ".distcp"

Shape = tuple[int, ...] | None
"""A tensor's (global) shape; ``None`` for a saved value that is not a tensor."""


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, unsafe to unpickle or saved from another model.

    The message names the checkpoint directory and the file at fault; both are also attributes.
    """

    def __init__(self, message: str, *, checkpoint: Path | None = None, file: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.file = file


def _damaged(checkpoint: Path, file: str, detail: str) -> CheckpointError:
    return CheckpointError(f"Checkpoint '{checkpoint}' is damaged: {detail}", checkpoint=checkpoint, file=file)


def _refused(checkpoint: Path, file: str, detail: str) -> CheckpointError:
    return CheckpointError(f"Checkpoint '{checkpoint}' is refused: {detail}", checkpoint=checkpoint, file=file)


# --- the directory as a whole ---------------------------------------------------------------------


def looks_like_sharded_checkpoint(path: Path) -> bool:
    """A directory holding any part of a sharded checkpoint (``.metadata``, ``meta.pt`` or a shard file).

    Unlike ``checkpoint.is_sharded_checkpoint`` this is also true for a half-written one, so that
    loading it ends in a clear :class:`CheckpointError` rather than in an attempt to read a directory
    as a single-file checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / DCP_METADATA_FILENAME).exists() or (path / TRAINER_STATE_FILENAME).exists():
        return True
    return any(child.name.endswith(SHARD_SUFFIX) for child in path.iterdir())


def is_half_written(path: Path) -> bool:
    """A sharded checkpoint directory that lacks ``.metadata`` or ``meta.pt``: an interrupted save, or a partly deleted one.

    DCP writes ``.metadata`` only after every rank wrote its shard file, so shard files without it were
    never finished; the trainer state is written separately by rank 0.
    """
    path = Path(path)
    complete = (path / DCP_METADATA_FILENAME).is_file() and (path / TRAINER_STATE_FILENAME).is_file()
    return looks_like_sharded_checkpoint(path) and not complete


def verify_sharded_checkpoint(path: Path) -> None:
    """Checks a sharded checkpoint before anything is loaded from it; raises :class:`CheckpointError`.

    Checked: ``.metadata`` exists and is DCP metadata (read without running code stored in it); every
    shard file it lists exists and is long enough for all the entries it should hold; the non-tensor
    entries of the shards are plain data; ``meta.pt`` exists and holds plain data (read with
    ``torch.load(weights_only=True)``). Only file sizes are checked for tensor data, which is not read.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"Checkpoint '{path}' is not a directory; a sharded checkpoint is a directory with"
            f" '{DCP_METADATA_FILENAME}', shard files and '{TRAINER_STATE_FILENAME}'.",
            checkpoint=path,
        )
    metadata = read_dcp_metadata(path)
    _check_shard_files(path, metadata)
    _check_byte_entries(path, metadata)
    load_trainer_state(path)


# --- DCP's .metadata ------------------------------------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATH_CLASSES = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")
_OTHER_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class _ForeignGlobal(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _metadata_global(module: str, name: str) -> Any:
    """The classes and functions DCP metadata is built from; ``None`` for anything else."""
    if (module, name) in _OTHER_GLOBALS:
        return _OTHER_GLOBALS[module, name]
    if not name.isidentifier():  # no dotted paths into other objects
        return None
    if module == "torch":
        value = getattr(torch, name, None)
        return value if isinstance(value, torch.dtype) else None
    if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:
        return getattr(pathlib, name)
    if module in _DCP_MODULES:
        value = getattr(importlib.import_module(module), name, None)
        is_data = isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
        if is_data and value.__module__ == module:
            return value
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        value = _metadata_global(module, name)
        if value is None:
            raise _ForeignGlobal(f"{module}.{name}")
        return value

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent IDs are not used by DCP metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint directory ``path``, unpickled without running code stored in it."""
    path = Path(path)
    file = path / DCP_METADATA_FILENAME
    name = DCP_METADATA_FILENAME
    if not file.is_file():
        detail = "is not a file" if file.exists() else "is missing"
        raise _damaged(path, name, f"'{name}' {detail} (a save that was interrupted leaves the directory so).")
    try:
        data = file.read_bytes()
    except OSError as error:
        raise _damaged(path, name, f"'{name}' cannot be read ({type(error).__name__}: {error}).") from error
    if not data:
        raise _damaged(path, name, f"'{name}' is empty (0 bytes).")
    not_dcp = f"'{name}' is not a Distributed Checkpoint metadata file"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _ForeignGlobal as error:
        raise _damaged(
            path, name, f"{not_dcp} (it refers to {error.name}, which DCP metadata never contains; not unpickled)."
        ) from None
    except Exception as error:  # any malformed pickle: UnpicklingError, EOFError, TypeError, ...
        raise _damaged(path, name, f"{not_dcp} (unreadable pickle data: {_first_line(error).rstrip('.')}).") from error
    if not isinstance(metadata, Metadata):
        kind = type(metadata).__qualname__
        raise _damaged(path, name, f"{not_dcp} (it holds a {kind}, not a {Metadata.__module__}.Metadata).")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise _damaged(path, name, f"{not_dcp} (its state_dict_metadata is not a dict).")
    return metadata


# --- shard files ----------------------------------------------------------------------------------


def _natural_key(name: str) -> list[Any]:
    """'__2_0.distcp' before '__10_0.distcp'."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _storage_items(path: Path, metadata: Metadata) -> list[tuple[Any, str, int, int, Any]]:
    """``(index, relative path, offset, length, transform descriptors)`` for every entry of the metadata."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        raise _damaged(
            path,
            DCP_METADATA_FILENAME,
            f"'{DCP_METADATA_FILENAME}' does not list the shard files (storage_data is"
            f" {type(storage).__qualname__}, not a dict); it was not written by DCP's file-system writer.",
        )
    items = []
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        fqn = getattr(index, "fqn", index)
        valid = isinstance(relative, str) and bool(relative) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, length)
        )
        if not valid:
            raise _damaged(
                path, DCP_METADATA_FILENAME, f"'{DCP_METADATA_FILENAME}' has an invalid storage entry for '{fqn}': {info!r}."
            )
        relative_path = PurePosixPath(relative.replace("\\", "/"))
        if relative_path.is_absolute() or ".." in relative_path.parts or PurePath(relative).is_absolute():
            raise _damaged(
                path,
                DCP_METADATA_FILENAME,
                f"'{DCP_METADATA_FILENAME}' points '{fqn}' to '{relative}', outside the checkpoint directory.",
            )
        items.append((index, relative, offset, length, getattr(info, "transform_descriptors", None)))
    return items


def _check_shard_files(path: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = {}
    for _, relative, offset, length, _ in _storage_items(path, metadata):
        needed[relative] = max(needed.get(relative, 0), offset + length)
    if metadata.state_dict_metadata and not needed:
        raise _damaged(path, DCP_METADATA_FILENAME, f"'{DCP_METADATA_FILENAME}' lists no shard files.")
    problems: list[tuple[str, str]] = []
    for relative in sorted(needed, key=_natural_key):
        file = path / relative
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            problems.append((relative, f"shard file '{relative}' is missing (listed in {DCP_METADATA_FILENAME})"))
            continue
        except OSError as error:
            problems.append((relative, f"shard file '{relative}' cannot be read ({type(error).__name__}: {error})"))
            continue
        if not file.is_file():
            problems.append((relative, f"shard file '{relative}' is not a file"))
        elif not os.access(file, os.R_OK):
            problems.append((relative, f"shard file '{relative}' is not readable"))
        elif size < needed[relative]:
            problems.append(
                (relative, f"shard file '{relative}' is truncated: {size} bytes, expected at least {needed[relative]}")
            )
    if problems:
        first_file, message = problems[0]
        if len(problems) > 1:
            others = ", ".join(f"'{relative}'" for relative, _ in problems[1:6])
            more = f" and {len(problems) - 6} more" if len(problems) > 6 else ""
            message += f"; also damaged: {others}{more}"
        raise _damaged(path, first_file, message + ".")


def _check_byte_entries(path: Path, metadata: Metadata) -> None:
    """Reads the non-tensor entries of the shards as plain data; DCP itself unpickles them unrestricted."""
    by_index = {entry[0]: entry[1:] for entry in _storage_items(path, metadata)}
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        entry = by_index.get(MetadataIndex(fqn))
        if entry is None:
            detail = f"'{DCP_METADATA_FILENAME}' lists '{fqn}' but not where it is stored."
            raise _damaged(path, DCP_METADATA_FILENAME, detail)
        relative, offset, length, transforms = entry
        if transforms:
            raise _refused(
                path,
                relative,
                f"shard file '{relative}' stores '{fqn}' through storage transforms ({', '.join(map(str, transforms))}),"
                " which this check cannot read; FSDP2Strategy never writes them.",
            )
        with open(path / relative, "rb") as stream:
            stream.seek(offset)
            data = stream.read(length)
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            found = _unsafe_global(error)
            raise _refused(
                path,
                relative,
                f"shard file '{relative}' holds '{fqn}' with objects that are not plain data{found} and will not be"
                " unpickled, since unpickling them can run arbitrary code.",
            ) from None
        except Exception as error:
            detail = f"shard file '{relative}' holds an unreadable entry '{fqn}' ({type(error).__name__}: {_first_line(error)})."
            raise _damaged(path, relative, detail) from error


# --- meta.pt: the trainer state as plain data -----------------------------------------------------

_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.device, torch.dtype, torch.layout)
_SEQUENCES: tuple[type, ...] = (list, tuple, set, torch.Size)
_MAPPINGS: tuple[type, ...] = (dict, OrderedDict, Counter)
_PLAIN = "dicts, lists, tuples, sets, str, int, float, bool, None and tensors"


class _NotPlain(Exception):
    def __init__(self, where: str, value: Any, hint: str) -> None:
        super().__init__(where)
        self.where, self.value, self.hint = where, value, hint


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _is_lightning_attribute_dict(value: Any) -> bool:
    kind = type(value)
    top = kind.__module__.split(".")[0]
    lightning = top in ("lightning", "lightning_fabric", "pytorch_lightning")
    return isinstance(value, dict) and kind.__name__ == "AttributeDict" and lightning


def _hint(where: str, value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f" Store its value ({value.value!r}) instead."
    match = re.fullmatch(r"checkpoint\['(?:datamodule_)?hyper_parameters'\]\[('[^']*')\]", where)
    if match:
        return f" Leave it out of the hyper-parameters: self.save_hyperparameters(ignore=[{match.group(1)}])."
    return " Store it as plain data instead (in the callback's state_dict or the module's on_save_checkpoint)."


def _plain(value: Any, where: str, active: set[int]) -> Any:
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind in (torch.Tensor, torch.nn.Parameter):
        return value
    if isinstance(value, torch.Tensor):
        raise _NotPlain(where, value, " Save a plain torch.Tensor (for a DTensor: .full_tensor()) instead.")
    if kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0 and kind.__name__ != "ndarray":
        return _plain(value.item(), where, active)  # numpy scalar -> Python number, same value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        raise _NotPlain(where, value, _hint(where, value))
    is_namespace = isinstance(value, argparse.Namespace)
    if kind in _MAPPINGS or is_namespace or _is_lightning_attribute_dict(value) or kind in _SEQUENCES:
        if id(value) in active:
            raise _NotPlain(where, value, " It contains itself.")
        active.add(id(value))
        try:
            if kind in _SEQUENCES:
                items = [_plain(item, f"{where}[{i}]", active) for i, item in enumerate(value)]
                return items if kind is list else kind(items)
            mapping = vars(value) if is_namespace else value
            result = {} if kind not in _MAPPINGS else kind()
            for key, item in mapping.items():
                new_key = _plain(key, f"{where} key {key!r}", active)
                if new_key in result:
                    raise _NotPlain(where, value, f" Two of its keys become {new_key!r}.")
                result[new_key] = _plain(item, f"{where}[{key!r}]", active)
            return result
        finally:
            active.discard(id(value))
    raise _NotPlain(where, value, _hint(where, value))


def to_plain_trainer_state(state: Mapping[str, Any], *, checkpoint: Path) -> dict[str, Any]:
    """A copy of the trainer state that ``torch.load(weights_only=True)`` reads back; raises ``TypeError`` otherwise.

    Kept as they are: dicts (also ``OrderedDict`` and ``Counter``), lists, tuples, sets, ``torch.Size``,
    str, int, float, complex, bool, None, bytes, ``torch.Tensor``/``Parameter``, ``torch.device``,
    ``torch.dtype``. Converted to plain data of the same value: Lightning's ``AttributeDict`` and
    ``argparse.Namespace`` (also jsonargparse's) to dict, ``pathlib`` paths to str, numpy scalars to
    Python numbers. Anything else (enums, modules, functions, other classes' instances, tensor
    subclasses, namedtuples, ...) is refused with the key path of the first such value: it would either
    not load back or need unpickling code named by the file. ``checkpoint`` is only used in messages.
    """
    try:
        return _plain(dict(state), "checkpoint", set())
    except _NotPlain as error:
        raise TypeError(
            f"Cannot save the trainer state of checkpoint '{checkpoint}' to '{TRAINER_STATE_FILENAME}':"
            f" {error.where} is a {_type_name(error.value)}, and '{TRAINER_STATE_FILENAME}' only holds plain data"
            f" ({_PLAIN}) so that it can be loaded without running code stored in it.{error.hint}"
        ) from None


def save_trainer_state(path: Path, state: Mapping[str, Any]) -> None:
    """Writes ``state`` as plain data to ``path / "meta.pt"``, atomically (an interrupted write leaves no file).

    Raises ``TypeError`` (see :func:`to_plain_trainer_state`) before writing anything if ``state``
    holds objects that are not plain data.
    """
    path = Path(path)
    plain = to_plain_trainer_state(state, checkpoint=path)
    path.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    data = buffer.getvalue()
    try:  # the walk above should make this impossible (e.g. a tensor carrying Python attributes)
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        raise TypeError(
            f"Cannot save the trainer state of checkpoint '{path}' to '{TRAINER_STATE_FILENAME}': it would not"
            f" load back with torch.load(weights_only=True) ({type(error).__name__}: {_first_line(error)})."
        ) from error
    target = path / TRAINER_STATE_FILENAME
    partial = path / f"{TRAINER_STATE_FILENAME}.partial"
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, target)


def load_trainer_state(path: Path, *, map_location: Any = "cpu", trusted: bool = False) -> dict[str, Any]:
    """The trainer state from ``path / "meta.pt"``, read with ``torch.load(weights_only=True)``.

    A file holding anything but plain data is refused (:class:`CheckpointError`) without running any
    code stored in it. ``trusted=True`` reads it with ``weights_only=False`` instead, which runs such
    code: only for checkpoints from a trusted source, e.g. to convert one written by an older version
    (load it this way once and write it back with :func:`save_trainer_state`).
    """
    path = Path(path)
    name = TRAINER_STATE_FILENAME
    file = path / name
    if not file.is_file():
        detail = "is not a file" if file.exists() else "is missing"
        raise _damaged(path, name, f"'{name}' {detail} (a save that was interrupted leaves the directory so).")
    try:
        size = file.stat().st_size
        with open(file, "rb"):
            pass
    except OSError as error:
        raise _damaged(path, name, f"'{name}' cannot be read ({type(error).__name__}: {error}).") from error
    if size == 0:
        raise _damaged(path, name, f"'{name}' is empty (0 bytes).")
    if not zipfile.is_zipfile(file):
        detail = f"'{name}' is truncated or not written by torch.save (no complete archive in its {size} bytes)."
        raise _damaged(path, name, detail)
    try:
        state = torch.load(file, map_location=map_location, weights_only=not trusted)
    except pickle.UnpicklingError as error:
        raise _refused(
            path,
            name,
            f"'{name}' contains objects that are not plain data{_unsafe_global(error)} and will not be unpickled,"
            " since unpickling them can run arbitrary code. If the checkpoint comes from a trusted source,"
            " convert it once: fsdp_strategy.integrity.save_trainer_state(path,"
            " load_trainer_state(path, trusted=True)).",
        ) from None
    except Exception as error:
        raise _damaged(path, name, f"'{name}' cannot be loaded ({type(error).__name__}: {_first_line(error)}).") from error
    if not isinstance(state, dict):
        raise _damaged(path, name, f"'{name}' holds a {_type_name(state)}, not a dict of trainer state.")
    return state


def _unsafe_global(error: BaseException) -> str:
    """`` (module.name)`` from torch's weights-only refusal, when it names the global it refused."""
    match = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f" ({match.group(1)})" if match else ""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"


# --- does the checkpoint fit the model? -----------------------------------------------------------


def saved_shapes(metadata: Metadata, prefix: str = "model.") -> dict[str, Shape]:
    """Key -> global shape of every entry under ``prefix`` in DCP metadata (prefix removed; ``None``: not a tensor)."""
    shapes: dict[str, Shape] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            shapes[key[len(prefix) :]] = tuple(item.size) if isinstance(item, TensorStorageMetadata) else None
    return shapes


def state_dict_shapes(state_dict: Mapping[str, Any]) -> dict[str, Shape]:
    """Key -> global shape (a DTensor's ``.shape`` is the global one) of a model state dict."""
    return {key: tuple(value.shape) if isinstance(value, torch.Tensor) else None for key, value in state_dict.items()}


def _quoted(keys: Iterable[str], limit: int) -> str:
    keys = list(keys)
    shown = ", ".join(f"'{key}'" for key in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else ("es" if noun.endswith("ch") else "s"))


def _shape(shape: Shape) -> str:
    return "not a tensor" if shape is None else str(tuple(shape))


def compare_keys(
    expected: Mapping[str, Shape],
    found: Mapping[str, Shape],
    *,
    checkpoint: Path,
    limit: int = 5,
    strict: bool = True,
    file: str = DCP_METADATA_FILENAME,
) -> None:
    """Raises :class:`CheckpointError` if the checkpoint's entries (``found``) do not fit the model's (``expected``).

    Both map keys to global shapes (``None``: not a tensor). The message lists the first ``limit``
    missing keys (in the model, not in the checkpoint), unexpected keys (in the checkpoint, not in the
    model) and shape mismatches, in the model's and the checkpoint's order. ``strict=False`` (Lightning's
    ``strict_loading=False``) tolerates missing and unexpected keys, never a shape mismatch.
    """
    missing = [key for key in expected if key not in found] if strict else []
    unexpected = [key for key in found if key not in expected] if strict else []
    mismatched = [key for key in expected if key in found and _differ(expected[key], found[key])]
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"{_plural(len(missing), 'missing key')} (in the model, not in the checkpoint): {_quoted(missing, limit)}")
    if unexpected:
        parts.append(
            f"{_plural(len(unexpected), 'unexpected key')} (in the checkpoint, not in the model): {_quoted(unexpected, limit)}"
        )
    if mismatched:
        shown = ", ".join(f"'{key}' {_shape(expected[key])} vs {_shape(found[key])}" for key in mismatched[:limit])
        more = f" and {len(mismatched) - limit} more" if len(mismatched) > limit else ""
        parts.append(f"{_plural(len(mismatched), 'shape mismatch')} (model vs checkpoint): {shown}{more}")
    raise CheckpointError(
        f"Checkpoint '{checkpoint}' was saved from a different model (as its '{file}' lists the"
        f" saved tensors): {'; '.join(parts)}.",
        checkpoint=Path(checkpoint),
        file=file,
    )


def _differ(expected: Shape, found: Shape) -> bool:
    if expected is None or found is None:
        return (expected is None) != (found is None)
    return tuple(expected) != tuple(found)


def check_model_matches(
    path: Path,
    model_state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    prefix: str = "model.",
    limit: int = 5,
    metadata: Metadata | None = None,
) -> None:
    """:func:`compare_keys` of a model state dict (``get_model_state_dict(model)``) and the checkpoint's ``prefix`` entries."""
    path = Path(path)
    metadata = read_dcp_metadata(path) if metadata is None else metadata
    compare_keys(
        state_dict_shapes(model_state_dict), saved_shapes(metadata, prefix), checkpoint=path, limit=limit, strict=strict
    )

