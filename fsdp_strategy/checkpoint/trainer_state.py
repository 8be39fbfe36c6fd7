"""``meta.pt``: Lightning's trainer state (epoch, loops, callbacks, schedulers, hyper-parameters, ...) next to the shards.

It holds the trainer state as DDP's checkpoint file holds it: hyper-parameters that are dataclasses, enums,
paths or OmegaConf configs are saved as those objects (:func:`check_trainer_state` refuses, before anything
is written, only what ``torch.save`` cannot pickle and DTensors).

Reading runs no code stored in a checkpoint unless the caller trusts it (``weights_only=False``, Lightning's
own switch): ``meta.pt``, and the non-tensor entries of the shard files (optimizer ``param_groups`` values
and the like, which DCP's default planner reads with ``torch.load(weights_only=False)``), are read by
:func:`torch_load` with ``weights_only=True``, which rebuilds torch's plain data, the types the user
registered with ``torch.serialization.add_safe_globals``, and the few harmless :data:`ACCEPTED_TYPES`; a
file holding other types is refused with their names and both fixes (:func:`refused_types`), as torch
refuses DDP's file.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import re
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp_strategy.checkpoint.errors import (
    CheckpointError,
    damaged,
    first_line,
    refused,
)
from fsdp_strategy.checkpoint.location import location_of
from fsdp_strategy.checkpoint.storage import checkpoint_files, read_checkpoint_file

__all__ = [
    "ACCEPTED_TYPES",
    "TRAINER_STATE_FILENAME",
    "check_trainer_state",
    "load_trainer_state",
    "refused_types",
    "save_trainer_state",
    "torch_load",
    "write_trainer_state",
]

TRAINER_STATE_FILENAME = "meta.pt"

# --- what loading accepts ------------------------------------------------------------------------

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


def refused_types(checkpoint: Path, file: str, what: str, data: bytes, error: BaseException) -> CheckpointError:
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
        return refused(checkpoint, file, detail)
    shown = ", ".join(names)
    classes = ", ".join(name.rsplit(".", 1)[-1] for name in names)
    detail = (
        f"{what} objects of types that are only loaded from a trusted file: {shown} (rebuilding an object runs"
        f" code of its type, so torch.load(weights_only=True) rebuilds only the types it is told are safe). {trust}"
        " Or, if they are your own types and safe to rebuild, register them in every process before loading:"
        f" torch.serialization.add_safe_globals([{classes}])."
    )
    return refused(checkpoint, file, detail)


def _weights_only_reason(error: BaseException) -> str:
    text = str(error)
    _, found, rest = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (rest if found else text).splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else type(error).__name__


# --- what saving accepts -------------------------------------------------------------------------


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
            f" {_type_name(value)}, which torch.save cannot pickle ({type(cause).__name__}: {first_line(cause)})."
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


# --- meta.pt -------------------------------------------------------------------------------------


def save_trainer_state(path: Path | str, state: Mapping[str, Any]) -> None:
    """Writes ``state`` to ``path / "meta.pt"`` with ``torch.save``, atomically (an interrupted write leaves no file).

    Raises ``TypeError`` (see :func:`check_trainer_state`) before writing anything if ``state`` cannot be saved.
    """
    where = location_of(path)
    write_trainer_state(where, check_trainer_state(state, checkpoint=where.value))


def write_trainer_state(path: Any, data: bytes) -> None:
    """Writes ``data``, the trainer state as :func:`check_trainer_state` returned it, to ``path / "meta.pt"`` atomically.

    A background save checks the state when it starts and writes these bytes when the shards are in:
    they are the state as it was at the save, whatever training changes meanwhile. ``path`` may be a URL
    (see :mod:`fsdp_strategy.checkpoint.storage`), where writing one object is atomic.
    """
    location_of(path).join(TRAINER_STATE_FILENAME).write_bytes(data)


def load_trainer_state(path: Any, *, map_location: Any = "cpu", weights_only: bool = True) -> dict[str, Any]:
    """The trainer state from ``path / "meta.pt"``, read by :func:`torch_load`.

    With ``weights_only=True`` (the default) a file holding types that are neither torch's plain data,
    nor registered with ``torch.serialization.add_safe_globals``, nor in :data:`ACCEPTED_TYPES` is
    refused (:class:`~fsdp_strategy.checkpoint.errors.CheckpointError` naming the types and both fixes)
    without running any code stored in it. ``weights_only=False`` loads everything, running such code:
    only for trusted checkpoints.
    """
    files = checkpoint_files(path)
    path, name = files.name, TRAINER_STATE_FILENAME
    data = read_checkpoint_file(files, name)
    if not zipfile.is_zipfile(io.BytesIO(data)):
        detail = f"'{name}' is truncated or not written by torch.save (no complete archive in its {len(data)} bytes)."
        raise damaged(path, name, detail)
    try:
        state = torch_load(io.BytesIO(data), weights_only=weights_only, map_location=map_location)
    except Exception as error:
        if weights_only and isinstance(error, pickle.UnpicklingError):
            raise refused_types(path, name, f"'{name}' holds", data, error) from None
        raise damaged(
            path, name, f"'{name}' cannot be loaded ({type(error).__name__}: {first_line(error)})."
        ) from error
    if not isinstance(state, dict):
        raise damaged(path, name, f"'{name}' holds a {_type_name(state)}, not a dict of trainer state.")
    return state
