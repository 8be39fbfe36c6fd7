"""A checkpoint's model weights, tensor by tensor, each read in blocks when it is written: nothing whole in memory.

:func:`read_model_weights` opens a checkpoint (:func:`~fsdp_strategy.checkpoint.reader.open_checkpoint`) and lists
the module's tensors with a way to read each one's bytes. In a sharded checkpoint a tensor saved as whole rows per
rank (FSDP's dim-0 shards) is read block by block straight from the shard files, one block in memory at a time;
any other is read whole through DCP. A single file is memory-mapped when local. The Hugging Face export
(:mod:`fsdp_strategy.tools.export`) writes what this reads.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from fsdp_strategy.checkpoint import storage
from fsdp_strategy.checkpoint.errors import damaged
from fsdp_strategy.checkpoint.layout import MODEL_KEY
from fsdp_strategy.checkpoint.peft_record import PEFT_KEY
from fsdp_strategy.checkpoint.reader import OpenedCheckpoint, open_checkpoint

__all__ = ["ModelWeights", "WeightEntry", "read_model_weights"]


@dataclass(frozen=True)
class WeightEntry:
    """One model tensor: its name (without the checkpoint's ``model.``), dtype, shape, and how to read its bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    blocks: Callable[[], Iterator[torch.Tensor]]  # the tensor's bytes as contiguous tensors, in order

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ModelWeights:
    """The module's tensors in its own order, the checkpoint's hyper-parameters, how many model entries it has
    (tensors or not), and its record of a ``peft`` model's adapters (:mod:`~fsdp_strategy.checkpoint.peft_record`)."""

    entries: list[WeightEntry]
    hyper_parameters: dict[str, Any]
    total: int
    peft_adapters: dict[str, Any] | None = None


def read_model_weights(checkpoint: Any, *, weights_only: bool) -> ModelWeights:
    """The model weights of ``checkpoint`` (a sharded directory or URL, or a single-file Lightning checkpoint)."""
    opened = open_checkpoint(checkpoint, weights_only=weights_only)
    return _sharded_weights(opened) if opened.sharded else _file_weights(opened)


def _sharded_weights(opened: OpenedCheckpoint) -> ModelWeights:
    """The model's tensors (names without the checkpoint's ``model`` key), the hyper-parameters, and how
    many model entries the checkpoint has (tensors or not)."""
    files, metadata = opened.files, opened.metadata
    trainer_state = opened.trainer_state()
    hyper_parameters = trainer_state.get("hyper_parameters") or {}
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
        blocks: Callable[[], Iterator[torch.Tensor]]
        if rows is not None:
            blocks = partial(_read_rows, files, rows, md)
        else:
            blocks = partial(_read_whole, opened, key)
        entries.append(WeightEntry(key[len(head) :], md.properties.dtype, tuple(md.size), blocks))
    return ModelWeights(entries, _as_dict(hyper_parameters), len(keys), trainer_state.get(PEFT_KEY))


def _read_whole(opened: OpenedCheckpoint, key: str) -> Iterator[torch.Tensor]:
    return (tensor for _, tensor in opened.read_tensors([key]))


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


def _read_rows(
    files: storage.CheckpointFiles, rows: list[tuple[Any, ...]], md: TensorStorageMetadata
) -> Iterator[torch.Tensor]:
    for relative, offset, length, count in rows:
        if count == 0:
            continue
        with files.open(relative) as stream:
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


def _file_weights(opened: OpenedCheckpoint) -> ModelWeights:
    """A single-file Lightning checkpoint (or a plain state dict), memory-mapped when local."""
    source = opened.source
    loaded = opened.load_file()
    state = (
        loaded.get("state_dict") if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict) else loaded
    )
    if not isinstance(state, dict):
        raise ValueError(f"'{source}' is neither a sharded checkpoint nor a checkpoint file with a 'state_dict'.")
    hyper_parameters = loaded.get("hyper_parameters") if state is not loaded else None
    entries = [
        WeightEntry(name, value.dtype, tuple(value.shape), lambda value=value: iter([value]))
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    ]
    peft_adapters = loaded.get(PEFT_KEY) if state is not loaded else None
    return ModelWeights(entries, _as_dict(hyper_parameters or {}), len(state), peft_adapters)


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    return dict(vars(value)) if hasattr(value, "__dict__") else {}


# --- the config -----------------------------------------------------------------------------------------
