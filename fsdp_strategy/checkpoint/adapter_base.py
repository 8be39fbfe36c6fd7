"""What an adapter checkpoint records of the base its frozen parameters come from: ``adapter.json`` in the checkpoint
directory, plain JSON (read without unpickling anything), which also tells the format apart from a sharded one.

It names each frozen parameter left out (shape and dtype), and the ``init_weights`` file the run started from with
the SHA-256 of its bytes. The bytes, not a header and sizes: a base fine-tuned further keeps its names, shapes and
sizes, and only its values tell it apart, which is what a resume must not mix up. Hashing is one sequential read of
the file, once per file and process (rank 0), at the first save and at a resume.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from fsdp_strategy.checkpoint.errors import CheckpointError, damaged
from fsdp_strategy.checkpoint.location import location_of
from fsdp_strategy.checkpoint.storage import CheckpointFiles, read_checkpoint_file

__all__ = ["RECORD_NAME", "BaseRecord", "check_base", "frozen_parameters", "weights_hash"]

RECORD_NAME = "adapter.json"
_FORMAT = "fsdp_strategy/adapter-checkpoint"
_CHUNK_BYTES = 16 * 2**20
_hashes: dict[tuple[str, float], str] = {}


@dataclass(frozen=True)
class BaseRecord:
    """The frozen parameters an adapter checkpoint leaves out (``{name: (shape, dtype)}``), and the ``init_weights``
    file they were loaded from (``None``: from the module as built) with its SHA-256."""

    frozen: dict[str, tuple[tuple[int, ...], str]]
    init_weights: str | None = None
    sha256: str | None = None

    def to_json(self) -> bytes:
        frozen = {name: {"shape": list(shape), "dtype": dtype} for name, (shape, dtype) in self.frozen.items()}
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
            frozen = {name: (tuple(entry["shape"]), entry["dtype"]) for name, entry in record["frozen"].items()}
            base = record["init_weights"]
            return cls(frozen, None if base is None else base["path"], None if base is None else base["sha256"])
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


def weights_hash(path: Path | str) -> str:
    """The SHA-256 of the bytes of the weights file ``path`` (a local path or a URL), hashed once per process."""
    where = location_of(path)
    key = (str(where), where.modified())
    if key not in _hashes:
        digest = hashlib.sha256()
        with where.open("rb") as file:
            while chunk := file.read(_CHUNK_BYTES):
                digest.update(chunk)
        _hashes[key] = digest.hexdigest()
    return _hashes[key]


def check_base(
    record: BaseRecord, init_weights: Path | str | None, module_shapes: dict[str, Any], *, checkpoint: Any
) -> None:
    """Refuses to resume from an adapter checkpoint onto another base than it was trained on: other ``init_weights``
    (by content), or a module whose frozen parameters are missing or of other shapes (``module_shapes``: the
    module's parameter shapes by name)."""
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
