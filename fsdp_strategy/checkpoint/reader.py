"""A checkpoint opened once for reading outside training, in one process, with no process group.

:func:`open_checkpoint` resolves where the checkpoint is (a local path, or a URL whose manifest names its
files), tells a sharded checkpoint from a single file, checks a sharded one whole
(:func:`~fsdp_strategy.checkpoint.verify.verify_sharded_checkpoint`) and reads its DCP index without running code
(:func:`~fsdp_strategy.checkpoint.dcp_metadata.read_dcp_metadata`). What it returns, a :class:`OpenedCheckpoint`,
is all the tools need to read it (``consolidate``, ``export``): its files, its index, its trainer state and its
entries, tensor by tensor. None of them looks at the location again.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from fsdp_strategy import host_memory
from fsdp_strategy.checkpoint import storage
from fsdp_strategy.checkpoint.dcp_metadata import (
    DCP_METADATA_FILENAME,
    read_dcp_metadata,
)
from fsdp_strategy.checkpoint.errors import first_line
from fsdp_strategy.checkpoint.location import location_of
from fsdp_strategy.checkpoint.state_dicts import load_checkpoint_file
from fsdp_strategy.checkpoint.trainer_state import (
    TRAINER_STATE_FILENAME,
    load_trainer_state,
    torch_load,
)
from fsdp_strategy.checkpoint.verify import is_sharded_checkpoint, verify_sharded_checkpoint

__all__ = ["OpenedCheckpoint", "open_checkpoint"]

# Each read loads the tensor's shards into buffers of their own before copying them into the tensor that
# is kept. glibc serves buffers below its mmap threshold (which grows up to 32 MiB) from the heap, and the
# freed ones stay resident as holes between the tensors kept: 11% of the state on top of it for a
# 100M-parameter model with AdamW saved by 2 ranks, 0.4% with malloc_trim(0), which hands those pages back.
_TRIM_AFTER_BYTES = 2**20


@dataclass
class OpenedCheckpoint:
    """One checkpoint, located and checked: a sharded one (``files`` and ``metadata`` set) or a single file."""

    source: Path | str  # a local path, or a URL
    weights_only: bool
    files: storage.CheckpointFiles | None = None
    metadata: Metadata | None = None
    _reader: FileSystemReader | None = field(default=None, repr=False)

    @property
    def sharded(self) -> bool:
        return self.metadata is not None

    @property
    def name(self) -> str:
        return self.files.name if self.files is not None else str(self.source)

    def trainer_state(self) -> dict[str, Any]:
        """``meta.pt`` of a sharded checkpoint: epoch, loops, callbacks, hyper-parameters, ..."""
        return load_trainer_state(self._sharded_files(), weights_only=self.weights_only)

    def load_file(self) -> Any:
        """A single-file checkpoint's contents (memory-mapped when local)."""
        return load_checkpoint_file(self.source, weights_only=self.weights_only)

    def tensor_keys(self) -> list[str]:
        return [key for key, md in self._index().items() if isinstance(md, TensorStorageMetadata)]

    def tensor_bytes(self, key: str) -> int:
        md = self._index()[key]
        return math.prod(md.size) * md.properties.dtype.itemsize

    def read_non_tensors(self, keys: list[str]) -> dict[str, Any]:
        """Non-tensor values (optimizer hyper-parameters, parameter names, ...) are small pickles: one read for all."""
        index = self._index()
        for key in keys:
            if not isinstance(index[key], BytesStorageMetadata):
                kind = type(index[key]).__name__
                raise ValueError(
                    f"cannot read {self.source}: entry {key!r} is stored as {kind}, which is not supported"
                )
        if not keys:
            return {}
        try:
            return self._read(dict.fromkeys(keys))
        except Exception as exc:
            raise ValueError(f"cannot read the non-tensor values of {self.source}: {first_line(exc)}") from exc

    def read_tensors(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor whole, one read each: its shards from all ranks' files are copied into one new tensor."""
        index = self._index()
        for key in keys:
            md = index[key]
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"cannot read {self.source}: entry {key!r} is not a tensor")
            tensor = torch.empty(md.size, dtype=md.properties.dtype)
            try:
                self._read({key: tensor})
            except MemoryError:
                raise
            except Exception as exc:
                raise ValueError(f"cannot read tensor {key!r} from {self.source}: {first_line(exc)}") from exc
            if tensor.numel() * tensor.element_size() >= _TRIM_AFTER_BYTES:
                host_memory.release()
            yield key, tensor

    def _read(self, entries: dict[str, Any]) -> dict[str, Any]:
        """One DCP read of ``entries`` (flat keys of the checkpoint): tensors are filled in place, other values replaced."""
        if self._reader is None:
            self._reader = self._sharded_files().reader()
            self._reader.set_up_storage_reader(self.metadata, True)
        planner = _CheckedPlanner(weights_only=self.weights_only)
        planner.set_up_planner(entries, self.metadata, True)
        plans = planner.create_global_plan([self._reader.prepare_local_plan(planner.create_local_plan())])
        plan = planner.finish_plan(self._reader.prepare_global_plan(plans)[0])
        self._reader.read_data(plan, planner).wait()
        return entries

    def _index(self) -> dict[str, Any]:
        if self.metadata is None:
            raise ValueError(f"{self.source} is a single-file checkpoint, not a sharded one")
        return self.metadata.state_dict_metadata

    def _sharded_files(self) -> storage.CheckpointFiles:
        if self.files is None:
            raise ValueError(f"{self.source} is a single-file checkpoint, not a sharded one")
        return self.files


class _CheckedPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries are read by ``trainer_state.torch_load`` (it uses ``weights_only=False``)."""

    def __init__(self, *, weights_only: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.weights_only = weights_only

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch_load(value, weights_only=self.weights_only)


def open_checkpoint(
    checkpoint: str | os.PathLike[str], *, weights_only: bool, sharded_only: bool = False
) -> OpenedCheckpoint:
    """``checkpoint`` (a sharded directory or URL, or a single file) located and, if sharded, checked whole.

    Raises ``FileNotFoundError`` if nothing is there, ``ValueError`` if it is not a checkpoint (with
    ``sharded_only``: not a sharded one), :class:`~fsdp_strategy.CheckpointError` if it is damaged.
    """
    where = location_of(checkpoint)
    source = where.value
    if not sharded_only and not is_sharded_checkpoint(where):
        return OpenedCheckpoint(source, weights_only)
    if not where.remote:  # a URL's manifest says what is there
        if not where.exists():
            raise FileNotFoundError(f"checkpoint directory {source} does not exist")
        if not where.is_dir():
            raise ValueError(
                f"{source} is not a directory; expected a sharded checkpoint directory (with .metadata and meta.pt)"
            )
    files = storage.checkpoint_files(where)  # a URL: its manifest, read once
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
    return OpenedCheckpoint(source, weights_only, files, metadata)
