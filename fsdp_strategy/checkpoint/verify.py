"""Checks that a sharded checkpoint directory is whole, safe to read and made for this model.

A sharded checkpoint is a Distributed Checkpoint (DCP) directory: DCP's index ``.metadata`` (read by
:mod:`fsdp_strategy.checkpoint.dcp_metadata`), the shard files ``__{rank}_0.distcp`` it points into, and ``meta.pt``
with Lightning's trainer state (read by :mod:`fsdp_strategy.checkpoint.trainer_state`). :func:`verify_sharded_checkpoint`
checks all of them before anything is loaded; :func:`check_model_matches` compares the saved keys and
shapes with the model's. Every problem is reported as a
:class:`~fsdp_strategy.checkpoint.errors.CheckpointError` naming the checkpoint directory and the file.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from fsdp_strategy.checkpoint.dcp_metadata import (
    DCP_METADATA_FILENAME,
    read_dcp_metadata,
)
from fsdp_strategy.checkpoint.errors import (
    CheckpointError,
    damaged,
    first_line,
    refused,
)
from fsdp_strategy.checkpoint.location import location_of
from fsdp_strategy.checkpoint.storage import CheckpointFiles, checkpoint_files, read_manifest
from fsdp_strategy.checkpoint.trainer_state import (
    TRAINER_STATE_FILENAME,
    load_trainer_state,
    refused_types,
    torch_load,
)

__all__ = [
    "check_model_matches",
    "compare_keys",
    "is_half_written",
    "is_sharded_checkpoint",
    "saved_shapes",
    "state_dict_shapes",
    "verify_sharded_checkpoint",
]

SHARD_SUFFIX = ".distcp"

Shape = tuple[int, ...] | None
"""A tensor's (global) shape; ``None`` for a saved value that is not a tensor."""


# --- the directory as a whole ---------------------------------------------------------------------


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether the checkpoint at ``path`` is sharded (rather than one file): the one test of it in the package.

    A directory holding any part of a sharded checkpoint (``.metadata``, ``meta.pt`` or a shard file), or a URL
    whose name is a sharded checkpoint's manifest (see :mod:`fsdp_strategy.checkpoint.storage`). A half-written
    local one counts, so that loading it ends in a clear :class:`CheckpointError` naming the missing file rather
    than in an attempt to read a directory as a single-file checkpoint.
    """
    where = location_of(path)
    if where.remote:
        try:
            return read_manifest(where) is not None
        except FileNotFoundError:
            return False
    if not where.is_dir():
        return False
    if where.join(DCP_METADATA_FILENAME).exists() or where.join(TRAINER_STATE_FILENAME).exists():
        return True
    return any(name.endswith(SHARD_SUFFIX) for name in where.names())


def is_half_written(path: Any) -> bool:
    """A sharded checkpoint directory that lacks ``.metadata`` or ``meta.pt``: an interrupted save, or a partly deleted one.

    DCP writes ``.metadata`` only after every rank wrote its shard file, so shard files without it were
    never finished; the trainer state is written separately by rank 0. A checkpoint on a URL is never
    half-written under its name: the name appears only once it is complete.
    """
    where = location_of(path)
    if where.remote or not is_sharded_checkpoint(where):
        return False
    return not (where.join(DCP_METADATA_FILENAME).is_file() and where.join(TRAINER_STATE_FILENAME).is_file())


def verify_sharded_checkpoint(path: Path | str | CheckpointFiles, *, weights_only: bool = True) -> None:
    """Checks a sharded checkpoint before anything is loaded from it; raises :class:`CheckpointError`.

    Checked: ``.metadata`` exists and is DCP metadata (read without running code stored in it); every
    shard file it lists exists and is long enough for all the entries it should hold; the non-tensor
    entries of the shards and ``meta.pt`` load with :func:`~fsdp_strategy.checkpoint.trainer_state.torch_load`
    (``weights_only=True``: without running code stored in them, else refused by type). Only file sizes
    are checked for tensor data, which is not read. ``weights_only=False`` trusts the checkpoint: its
    pickled objects are loaded whatever they are, running the code they name. ``path`` may be a URL
    (its manifest is followed) or the :class:`~fsdp_strategy.checkpoint.storage.CheckpointFiles` of one.
    """
    files = path if isinstance(path, CheckpointFiles) else _local_directory_or_url(path)
    metadata = read_dcp_metadata(files)
    _check_shard_files(files, metadata)
    _check_byte_entries(files, metadata, weights_only=weights_only)
    load_trainer_state(files, weights_only=weights_only)


def _local_directory_or_url(path: Path | str) -> CheckpointFiles:
    where = location_of(path)
    if not where.remote and not where.is_dir():  # on a URL, the manifest tells (checkpoint_files)
        raise CheckpointError(
            f"Checkpoint '{path}' is not a directory; a sharded checkpoint is a directory with"
            f" '{DCP_METADATA_FILENAME}', shard files and '{TRAINER_STATE_FILENAME}'.",
            checkpoint=Path(path),
        )
    return checkpoint_files(where)


# --- shard files ----------------------------------------------------------------------------------


def _natural_key(name: str) -> list[Any]:
    """'__2_0.distcp' before '__10_0.distcp'."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _storage_items(path: Path | str, metadata: Metadata) -> list[tuple[Any, str, int, int, Any]]:
    """``(index, relative path, offset, length, transform descriptors)`` for every entry of the metadata."""
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        raise damaged(
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
        valid = (
            isinstance(relative, str)
            and bool(relative)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, length))
        )
        if not valid:
            raise damaged(
                path,
                DCP_METADATA_FILENAME,
                f"'{DCP_METADATA_FILENAME}' has an invalid storage entry for '{fqn}': {info!r}.",
            )
        relative_path = PurePosixPath(relative.replace("\\", "/"))
        if relative_path.is_absolute() or ".." in relative_path.parts or PurePath(relative).is_absolute():
            raise damaged(
                path,
                DCP_METADATA_FILENAME,
                f"'{DCP_METADATA_FILENAME}' points '{fqn}' to '{relative}', outside the checkpoint directory.",
            )
        items.append((index, relative, offset, length, getattr(info, "transform_descriptors", None)))
    return items


def _check_shard_files(files: CheckpointFiles, metadata: Metadata) -> None:
    path = files.name
    needed: dict[str, int] = {}
    for _, relative, offset, length, _ in _storage_items(path, metadata):
        needed[relative] = max(needed.get(relative, 0), offset + length)
    if metadata.state_dict_metadata and not needed:
        raise damaged(path, DCP_METADATA_FILENAME, f"'{DCP_METADATA_FILENAME}' lists no shard files.")
    problems: list[tuple[str, str]] = []
    for relative in sorted(needed, key=_natural_key):
        try:
            size = files.size(relative)
        except FileNotFoundError:
            problems.append((relative, f"shard file '{relative}' is missing (listed in {DCP_METADATA_FILENAME})"))
            continue
        except OSError as error:
            problems.append((relative, f"shard file '{relative}' cannot be read ({type(error).__name__}: {error})"))
            continue
        if not files.is_file(relative):
            problems.append((relative, f"shard file '{relative}' is not a file"))
        elif not files.readable(relative):
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
        raise damaged(path, first_file, message + ".")


def _check_byte_entries(files: CheckpointFiles, metadata: Metadata, *, weights_only: bool) -> None:
    """Reads the non-tensor entries of the shards as ``torch_load`` does; DCP itself unpickles them unrestricted."""
    path = files.name
    by_index = {entry[0]: entry[1:] for entry in _storage_items(path, metadata)}
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        entry = by_index.get(MetadataIndex(fqn))
        if entry is None:
            detail = f"'{DCP_METADATA_FILENAME}' lists '{fqn}' but not where it is stored."
            raise damaged(path, DCP_METADATA_FILENAME, detail)
        relative, offset, length, transforms = entry
        if transforms:
            raise refused(
                path,
                relative,
                f"shard file '{relative}' stores '{fqn}' through storage transforms ({', '.join(map(str, transforms))}),"
                " which this check cannot read; FSDP2Strategy never writes them.",
            )
        data = files.read_range(relative, offset, length)
        try:
            torch_load(io.BytesIO(data), weights_only=weights_only)
        except Exception as error:
            if weights_only and isinstance(error, pickle.UnpicklingError):
                raise refused_types(
                    path, relative, f"shard file '{relative}' holds '{fqn}' with", data, error
                ) from None
            detail = f"shard file '{relative}' holds an unreadable entry '{fqn}' ({type(error).__name__}: {first_line(error)})."
            raise damaged(path, relative, detail) from error


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
    checkpoint: Path | str,
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
        parts.append(
            f"{_plural(len(missing), 'missing key')} (in the model, not in the checkpoint): {_quoted(missing, limit)}"
        )
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
        checkpoint=checkpoint,
        file=file,
    )


def _differ(expected: Shape, found: Shape) -> bool:
    if expected is None or found is None:
        return (expected is None) != (found is None)
    return tuple(expected) != tuple(found)


def check_model_matches(
    path: Path | str | CheckpointFiles,
    model_state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    prefix: str = "model.",
    limit: int = 5,
    metadata: Metadata | None = None,
) -> None:
    """:func:`compare_keys` of a model state dict (``get_model_state_dict(model)``) and the checkpoint's ``prefix`` entries."""
    files = checkpoint_files(path)
    metadata = read_dcp_metadata(files) if metadata is None else metadata
    compare_keys(
        state_dict_shapes(model_state_dict),
        saved_shapes(metadata, prefix),
        checkpoint=files.name,
        limit=limit,
        strict=strict,
    )
