"""What an adapter checkpoint records of the base its frozen parameters come from: ``adapter.json`` in the checkpoint
directory, plain JSON (read without unpickling anything), which also tells the format apart from a sharded one.

It names each frozen parameter left out (shape and dtype, and where the values come from the module as built, the
float64 sum and sum of squares of its values, taken once per run), and the ``init_weights`` file the run started
from with the SHA-256 of its bytes (a Hugging Face weights directory: of its safetensors files and index, in name
order). The bytes, not a header and sizes: a base fine-tuned further keeps its names, shapes and sizes, and only
its values tell it apart, which is what a resume must not mix up. Hashing is one sequential read of the files, once
per source and process (rank 0), at the first save and at a resume.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fsdp_strategy.checkpoint.errors import CheckpointError, damaged
from fsdp_strategy.checkpoint.location import location_of
from fsdp_strategy.checkpoint.pretrained import INDEX_NAME, is_weights_directory, weight_files
from fsdp_strategy.checkpoint.storage import CheckpointFiles, read_checkpoint_file

__all__ = [
    "RECORD_NAME",
    "BaseRecord",
    "check_base",
    "check_values",
    "frozen_parameters",
    "value_moments",
    "weights_hash",
]

RECORD_NAME = "adapter.json"
_FORMAT = "fsdp_strategy/adapter-checkpoint"
_CHUNK_BYTES = 16 * 2**20
_hashes: dict[tuple[str, Any], str] = {}


@dataclass(frozen=True)
class BaseRecord:
    """The frozen parameters an adapter checkpoint leaves out (``{name: (shape, dtype)}``), and the ``init_weights``
    file they were loaded from (``None``: from the module as built) with its SHA-256."""

    frozen: dict[str, tuple[tuple[int, ...], str]]
    init_weights: str | None = None
    sha256: str | None = None
    moments: dict[str, tuple[float, float]] = field(default_factory=dict)  # the values' sum and sum of squares

    def to_json(self) -> bytes:
        frozen = {name: {"shape": list(shape), "dtype": dtype} for name, (shape, dtype) in self.frozen.items()}
        for name, (total, squares) in self.moments.items():
            frozen[name].update(sum=total, sum_of_squares=squares)
        base = None if self.init_weights is None else {"path": self.init_weights, "sha256": self.sha256}
        record = {"format": _FORMAT, "init_weights": base, "frozen": frozen}
        return json.dumps(record, indent=2).encode() + b"\n"

    @classmethod
    def read(cls, files: CheckpointFiles) -> BaseRecord:
        """The record of the adapter checkpoint ``files``; a missing or unreadable one is named as damaged."""
        data = read_checkpoint_file(files, RECORD_NAME)
        try:
            record = json.loads(data)
            if record.get("format") != _FORMAT:
                raise ValueError(f"its 'format' is {record.get('format')!r}, not {_FORMAT!r}")
            entries = record["frozen"].items()
            frozen = {name: (tuple(entry["shape"]), entry["dtype"]) for name, entry in entries}
            moments = {name: (float(e["sum"]), float(e["sum_of_squares"])) for name, e in entries if "sum" in e}
            base = record["init_weights"]
            path, sha256 = (None, None) if base is None else (base["path"], base["sha256"])
            return cls(frozen, path, sha256, moments)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            detail = f"'{RECORD_NAME}' is not the record of an adapter checkpoint ({type(error).__name__}: {error})."
            raise damaged(files.name, RECORD_NAME, detail) from error


def frozen_parameters(model: nn.Module, optimizers: Iterable[Optimizer]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The parameters an adapter checkpoint leaves out, by every name they have (tied ones under each), with their
    global shapes and dtypes: those that need no gradient and have no optimizer state (a parameter trained, then
    frozen, holds values the base does not: it is saved)."""
    with_state = {id(p) for optimizer in optimizers for p in optimizer.state}
    return {
        name: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
        for name, p in model.named_parameters(remove_duplicate=False)
        if not p.requires_grad and id(p) not in with_state
    }


def value_moments(model: nn.Module, names: Iterable[str], dtypes: dict[str, str]) -> dict[str, tuple[float, float]]:
    """The sum and the sum of squares (in float64) of the values of the parameters ``names`` of ``model``, each cast
    to its dtype in ``dtypes`` first (as the record names it): a fingerprint of the frozen base that the shards give
    as the whole tensors do, to within float64 rounding. A collective per sharded parameter: every rank calls it."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    moments = {}
    for name in names:
        values = parameters[name].detach().to(getattr(torch, dtypes[name])).to(torch.float64)
        total, squares = values.sum(), (values * values).sum()
        if isinstance(values, DTensor):
            total, squares = total.full_tensor(), squares.full_tensor()
        moments[name] = (float(total), float(squares))
    return moments


def _same_values(saved: tuple[float, float], built: tuple[float, float], count: int) -> bool:
    # float64 sums of the same values in other orders (shards, then ranks) differ by rounding only: far below 1e-7 of
    # their scale, which any other values of the weights exceed.
    scale = math.sqrt(max(count, 1) * max(saved[1], built[1], 1e-30))
    return abs(saved[0] - built[0]) <= 1e-7 * scale and math.isclose(saved[1], built[1], rel_tol=1e-7, abs_tol=1e-30)


def weights_hash(path: Path | str) -> str:
    """The SHA-256 of the bytes of the weights ``path``, hashed once per process: a file (a local path or a URL), or
    a Hugging Face weights directory, whose safetensors files and index are hashed in name order."""
    if is_weights_directory(path):
        files = sorted({*weight_files(path).values(), *([INDEX_NAME] if (Path(path) / INDEX_NAME).is_file() else [])})
        key = (str(Path(path).resolve()), tuple((name, (Path(path) / name).stat().st_mtime) for name in files))
        if key not in _hashes:
            digest = hashlib.sha256()
            for name in files:  # each file behind its name and size: where one ends is part of the content
                digest.update(f"{name}\0{(Path(path) / name).stat().st_size}\0".encode())
                with open(Path(path) / name, "rb") as file:
                    _read_into(digest, file)
            _hashes[key] = digest.hexdigest()
        return _hashes[key]
    where = location_of(path)
    key = (str(where), where.modified())
    if key not in _hashes:
        digest = hashlib.sha256()
        with where.open("rb") as file:
            _read_into(digest, file)
        _hashes[key] = digest.hexdigest()
    return _hashes[key]


def _read_into(digest: Any, file: Any) -> None:
    while chunk := file.read(_CHUNK_BYTES):
        digest.update(chunk)


def check_base(record: BaseRecord, init_weights: Path | str | None, module: nn.Module, *, checkpoint: Any) -> None:
    """Refuses to resume from an adapter checkpoint onto another base than it was trained on: other ``init_weights``
    (by content), or a module (whole, before sharding) whose frozen parameters are missing, of other shapes, or
    (without ``init_weights``, where it was built with values) of other values than those the run saved beside."""
    module_shapes = {name: tuple(p.shape) for name, p in module.named_parameters(remove_duplicate=False)}
    given = None if init_weights is None else str(init_weights)
    if record.init_weights is not None or given is not None:
        current = None if given is None else weights_hash(given)
        if current != record.sha256:
            was = "none" if record.init_weights is None else f"'{record.init_weights}' (sha256 {record.sha256})"
            now = "none" if given is None else f"'{given}' (sha256 {current})"
            raise CheckpointError(
                f"The adapter checkpoint '{checkpoint}' was trained on `init_weights` {was}; this run's `init_weights`"
                f" is {now}. Its frozen parameters come from there: pass `init_weights` with the file it was trained"
                " on.",
                checkpoint=checkpoint,
                file=RECORD_NAME,
            )
    missing = [name for name in record.frozen if name not in module_shapes]
    reshaped = [
        name
        for name, (shape, _) in record.frozen.items()
        if name in module_shapes and tuple(module_shapes[name]) != shape
    ]
    if missing or reshaped:
        name = (missing or reshaped)[0]
        found = "is not in the module" if missing else f"has shape {tuple(module_shapes[name])} in the module"
        raise CheckpointError(
            f"The adapter checkpoint '{checkpoint}' was trained on a base whose frozen parameter '{name}' had shape"
            f" {record.frozen[name][0]}; it {found} ({len(missing)} missing, {len(reshaped)} of other shapes): build"
            " the module it was trained on.",
            checkpoint=checkpoint,
            file=RECORD_NAME,
        )
    parameters = dict(module.named_parameters(remove_duplicate=False))
    if given is None and not any(
        parameters[name].is_meta or isinstance(parameters[name], DTensor) for name in record.moments
    ):
        # Built with values: checked now. Without values, or the shards an earlier stage left (whose collectives rank
        # 0 cannot run alone): once sharded (check_values on every rank). From `init_weights`: by their hash above.
        check_values(record, module, checkpoint=checkpoint)


def check_values(record: BaseRecord, module: nn.Module, *, checkpoint: Any) -> None:
    """Refuses a module whose frozen parameters hold other values than those the adapter checkpoint was trained on,
    by the sums the record holds (:func:`value_moments`; sharded, every rank calls it)."""
    if not record.moments:
        return
    dtypes = {name: dtype for name, (_, dtype) in record.frozen.items()}
    counts = {name: p.numel() for name, p in module.named_parameters(remove_duplicate=False)}
    built = value_moments(module, record.moments, dtypes)
    other = [name for name, saved in record.moments.items() if not _same_values(saved, built[name], counts[name])]
    if other:
        raise CheckpointError(
            f"The adapter checkpoint '{checkpoint}' was trained on a base whose frozen parameter '{other[0]}' had other"
            f" values than the module built for this resume has ({len(other)} of {len(record.moments)} frozen"
            " parameters differ, by the sums of their values that the checkpoint records): build the module from the"
            " weights it was trained on, or pass them as `init_weights` (a module built without values, with"
            " `meta_init` or `init_module(empty_init=True)`, draws new values for them).",
            checkpoint=checkpoint,
            file=RECORD_NAME,
        )
