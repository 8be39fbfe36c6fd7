"""Checks that a sharded checkpoint directory is whole, safe to read and made for this model.

A sharded checkpoint is a Distributed Checkpoint (DCP) directory: DCP's index ``.metadata`` (a pickled
``torch.distributed.checkpoint.metadata.Metadata``), the shard files ``__{rank}_0.distcp`` it points
into, and ``meta.pt`` with Lightning's trainer state (epoch, loops, callbacks, schedulers, ...).

``meta.pt`` holds the trainer state as DDP's checkpoint file holds it: hyper-parameters that are
dataclasses, enums, paths or OmegaConf configs are saved as those objects (:func:`save_trainer_state`
refuses, before anything is written, only what ``torch.save`` cannot pickle).

Nothing here runs code stored in a checkpoint unless the caller trusts it (``weights_only=False``,
Lightning's own switch):

* ``.metadata`` is read by an unpickler that only builds the classes DCP metadata is made of (DCP's own
  ``dcp.load`` reads it with plain :func:`pickle.load`, which would run whatever the file asks for);
* the non-tensor entries of the shard files (optimizer ``param_groups`` values and the like, which
  DCP's default planner reads with ``torch.load(weights_only=False)``) and ``meta.pt`` are read with
  ``torch.load(weights_only=True)``, which rebuilds torch's plain data, the types the user registered
  with ``torch.serialization.add_safe_globals``, and the few harmless :data:`ACCEPTED_TYPES`; a file
  holding other types is refused with their names, as torch refuses DDP's file.

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
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.tensor import DTensor

__all__ = [
    "ACCEPTED_TYPES",
    "DCP_METADATA_FILENAME",
    "TRAINER_STATE_FILENAME",
    "CheckpointError",
    "check_model_matches",
    "check_trainer_state",
    "compare_keys",
    "is_half_written",
    "load_trainer_state",
    "looks_like_sharded_checkpoint",
    "read_dcp_metadata",
    "save_trainer_state",
    "saved_shapes",
    "state_dict_shapes",
    "torch_load",
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


def verify_sharded_checkpoint(path: Path, *, weights_only: bool = True) -> None:
    """Checks a sharded checkpoint before anything is loaded from it; raises :class:`CheckpointError`.

    Checked: ``.metadata`` exists and is DCP metadata (read without running code stored in it); every
    shard file it lists exists and is long enough for all the entries it should hold; the non-tensor
    entries of the shards and ``meta.pt`` load with :func:`torch_load` (``weights_only=True``: without
    running code stored in them, else refused by type). Only file sizes are checked for tensor data,
    which is not read. ``weights_only=False`` trusts the checkpoint: its pickled objects are loaded
    whatever they are, running the code they name.
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
    _check_byte_entries(path, metadata, weights_only=weights_only)
    load_trainer_state(path, weights_only=weights_only)


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


def _check_byte_entries(path: Path, metadata: Metadata, *, weights_only: bool) -> None:
    """Reads the non-tensor entries of the shards as :func:`torch_load` does; DCP itself unpickles them unrestricted."""
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
            torch_load(io.BytesIO(data), weights_only=weights_only)
        except Exception as error:
            if weights_only and isinstance(error, pickle.UnpicklingError):
                raise _refused_types(path, relative, f"shard file '{relative}' holds '{fqn}' with", data, error) from None
            detail = f"shard file '{relative}' holds an unreadable entry '{fqn}' ({type(error).__name__}: {_first_line(error)})."
            raise _damaged(path, relative, detail) from error


# --- meta.pt: the trainer state, as DDP's checkpoint file holds it ---------------------------------

ACCEPTED_TYPES: tuple[type, ...] = (
    argparse.Namespace,
    pathlib.PurePath,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
    pathlib.Path,
    pathlib.PosixPath,
    pathlib.WindowsPath,
)
"""Types that loading with ``weights_only=True`` accepts without the user registering them.

Rebuilding them runs only the standard library on data from the file (a path from its string parts, a
``Namespace`` by filling its ``__dict__``), never code the file names. Everything else beyond torch's own
plain data is loaded only when registered with ``torch.serialization.add_safe_globals`` or with
``weights_only=False``, exactly as for DDP's checkpoint file.
"""


def _accepted_globals() -> list[Any]:
    entries: list[Any] = []
    for kind in ACCEPTED_TYPES:
        entries.append(kind)
        if kind.__module__ in ("pathlib", "pathlib._local"):  # Python 3.13 moved them to pathlib._local
            other = "pathlib._local" if kind.__module__ == "pathlib" else "pathlib"
            entries.append((kind, f"{other}.{kind.__qualname__}"))
    return entries


@contextmanager
def _accepting_config_types() -> Iterator[None]:
    # torch.load(weights_only=True) has no per-call allow-list, only the process-wide one; add ours for
    # this load, leaving out what the user registered already (leaving the block removes what it added).
    registered = set(torch.serialization.get_safe_globals())
    with torch.serialization.safe_globals([entry for entry in _accepted_globals() if entry not in registered]):
        yield


def torch_load(source: Any, *, weights_only: bool = True, map_location: Any = "cpu") -> Any:
    """``torch.load`` of a checkpoint's pickled objects, read as DDP's checkpoint file is.

    ``weights_only=True``: torch's weights-only unpickler, which rebuilds torch's plain data, the types
    registered with ``torch.serialization.add_safe_globals`` and :data:`ACCEPTED_TYPES`, and raises
    ``pickle.UnpicklingError`` for anything else without running it. ``weights_only=False`` unpickles
    everything, running whatever code the file names: only for checkpoints from a trusted source.
    """
    if not weights_only:
        return torch.load(source, map_location=map_location, weights_only=False)
    with _accepting_config_types():
        return torch.load(source, map_location=map_location, weights_only=True)


def _refused_types(checkpoint: Path, file: str, what: str, data: bytes, error: BaseException) -> CheckpointError:
    """The refusal of a ``weights_only=True`` load: the types, and the two ways to load them."""
    try:
        with _accepting_config_types():
            names = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))))
    except Exception:  # a pickle its scanner does not know: torch's own message still names the type
        names = [match.group(1)] if (match := re.search(r"GLOBAL ([\w.]+)", str(error))) else []
    trust = (
        "If you trust this checkpoint, load it with weights_only=False: trainer.fit(model, ckpt_path=...,"
        " weights_only=False) (likewise validate, test and predict), consolidate_checkpoint(...,"
        " weights_only=False) or fsdp-strategy consolidate --no-weights-only."
    )
    if not names:  # every type is allowed, yet torch cannot rebuild them (e.g. a dict subclass)
        reason = _weights_only_reason(error)
        detail = f"{what} objects that torch.load(weights_only=True) cannot rebuild ({reason}). {trust}"
        return _refused(checkpoint, file, detail)
    shown = ", ".join(names)
    classes = ", ".join(name.rsplit(".", 1)[-1] for name in names)
    detail = (
        f"{what} objects of types that are only loaded from a trusted file: {shown} (rebuilding an object runs"
        f" code of its type, so torch.load(weights_only=True) rebuilds only the types it is told are safe). {trust}"
        " Or, if they are your own types and safe to rebuild, register them in every process before loading:"
        f" torch.serialization.add_safe_globals([{classes}])."
    )
    return _refused(checkpoint, file, detail)


def _weights_only_reason(error: BaseException) -> str:
    text = str(error)
    _, found, rest = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (rest if found else text).splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else type(error).__name__


def check_trainer_state(state: Mapping[str, Any], *, checkpoint: Path) -> bytes:
    """``state`` as ``torch.save`` writes it to ``meta.pt``; raises ``TypeError`` naming the first value it cannot hold.

    The objects are kept as they are, as in DDP's checkpoint file: dataclasses, enums, namedtuples, paths,
    OmegaConf configs and any other object that pickles. Refused, with its key path (e.g.
    ``checkpoint['hyper_parameters']['loss_fn']``): what ``torch.save`` cannot pickle (lambdas, classes or
    functions defined inside a function, open files, ...) and DTensors (rank 0 writes ``meta.pt`` alone,
    so it would hold rank 0's shard only). Every rank calls this before any rank writes, so a refused
    state leaves nothing half-written. ``checkpoint`` is only used in messages.
    """
    state = dict(state)
    dtensor = _find_dtensor(state, "checkpoint", set())
    if dtensor is not None:
        raise TypeError(
            f"Cannot save the trainer state of checkpoint '{checkpoint}' to '{TRAINER_STATE_FILENAME}':"
            f" {dtensor} is a DTensor, and '{TRAINER_STATE_FILENAME}' is written by rank 0 alone, so it would"
            " hold rank 0's shard only. Save value.full_tensor() instead."
        )
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except Exception as error:
        where, value, cause = _unpicklable(state, "checkpoint", set()) or ("checkpoint", state, error)
        raise TypeError(
            f"Cannot save the trainer state of checkpoint '{checkpoint}' to '{TRAINER_STATE_FILENAME}': {where} is a"
            f" {_type_name(value)}, which torch.save cannot pickle ({type(cause).__name__}: {_first_line(cause)})."
            f"{_hint(where)}"
        ) from error
    return buffer.getvalue()


def _children(value: Any, *, objects: bool) -> Iterator[tuple[str, Any]]:
    """What ``value`` holds, each with the suffix it adds to the key path; ``objects``: also other objects' attributes.

    Mappings other than dicts (an OmegaConf ``DictConfig``) are entered through their attributes, never
    their items: reading those can resolve interpolations.
    """
    if isinstance(value, (torch.Tensor, type)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                yield f" key {key!r}", key
            yield f"[{key!r}]", item
    elif isinstance(value, (list, tuple, set, frozenset)):
        for index, item in enumerate(value):
            yield f"[{index}]", item
    elif objects and isinstance(getattr(value, "__dict__", None), dict):  # dataclasses, Namespace, most objects
        for name, item in vars(value).items():
            yield f".{name}", item


def _find_dtensor(value: Any, where: str, seen: set[int]) -> str | None:
    """The key path of the first DTensor in ``value``'s dicts, lists, tuples and sets (where callbacks keep tensors)."""
    if isinstance(value, DTensor):
        return where
    if id(value) in seen:
        return None
    seen.add(id(value))
    for suffix, child in _children(value, objects=False):
        found = _find_dtensor(child, where + suffix, seen)
        if found is not None:
            return found
    return None


def _unpicklable(value: Any, where: str, seen: set[int]) -> tuple[str, Any, BaseException] | None:
    """The deepest value in ``value`` that ``torch.save`` cannot pickle, with its key path and the error."""
    try:
        torch.save(value, io.BytesIO())
    except Exception as error:
        if id(value) not in seen:
            seen.add(id(value))
            for suffix, child in _children(value, objects=True):
                found = _unpicklable(child, where + suffix, seen)
                if found is not None:
                    return found
        return where, value, error
    return None


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _hint(where: str) -> str:
    match = re.match(r"checkpoint\['(?:datamodule_)?hyper_parameters'\]\[('[^']*')\]", where)
    if match:
        return (
            " Define it at module level, or leave it out of the hyper-parameters:"
            f" self.save_hyperparameters(ignore=[{match.group(1)}])."
        )
    return " Define it at module level, or store it in a form that pickles (e.g. plain data)."


def save_trainer_state(path: Path, state: Mapping[str, Any]) -> None:
    """Writes ``state`` to ``path / "meta.pt"`` with ``torch.save``, atomically (an interrupted write leaves no file).

    Raises ``TypeError`` (see :func:`check_trainer_state`) before writing anything if ``state`` cannot be saved.
    """
    path = Path(path)
    data = check_trainer_state(state, checkpoint=path)
    path.mkdir(parents=True, exist_ok=True)
    target = path / TRAINER_STATE_FILENAME
    partial = path / f"{TRAINER_STATE_FILENAME}.partial"
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, target)


def load_trainer_state(path: Path, *, map_location: Any = "cpu", weights_only: bool = True) -> dict[str, Any]:
    """The trainer state from ``path / "meta.pt"``, read by :func:`torch_load`.

    With ``weights_only=True`` (the default) a file holding types that are neither torch's plain data,
    nor registered with ``torch.serialization.add_safe_globals``, nor in :data:`ACCEPTED_TYPES` is
    refused (:class:`CheckpointError` naming the types and both fixes) without running any code stored
    in it. ``weights_only=False`` loads everything, running such code: only for trusted checkpoints.
    """
    path = Path(path)
    name = TRAINER_STATE_FILENAME
    file = path / name
    if not file.is_file():
        detail = "is not a file" if file.exists() else "is missing"
        raise _damaged(path, name, f"'{name}' {detail} (a save that was interrupted leaves the directory so).")
    try:
        data = file.read_bytes()
    except OSError as error:
        raise _damaged(path, name, f"'{name}' cannot be read ({type(error).__name__}: {error}).") from error
    if not data:
        raise _damaged(path, name, f"'{name}' is empty (0 bytes).")
    if not zipfile.is_zipfile(io.BytesIO(data)):
        detail = f"'{name}' is truncated or not written by torch.save (no complete archive in its {len(data)} bytes)."
        raise _damaged(path, name, detail)
    try:
        state = torch_load(io.BytesIO(data), weights_only=weights_only, map_location=map_location)
    except Exception as error:
        if weights_only and isinstance(error, pickle.UnpicklingError):
            raise _refused_types(path, name, f"'{name}' holds", data, error) from None
        raise _damaged(path, name, f"'{name}' cannot be loaded ({type(error).__name__}: {_first_line(error)}).") from error
    if not isinstance(state, dict):
        raise _damaged(path, name, f"'{name}' holds a {_type_name(state)}, not a dict of trainer state.")
    return state


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

