"""Replaying the initialization :mod:`fsdp_strategy.sharding.deferred_init` recorded, on each rank's shards.

A :class:`Record` holds how one parameter gets its values: values it started from (``initial``, or
``base``: another record's values converted, as ``.half()`` or ``.clone()`` made them), then the in-place
writes made to it, in order. :func:`materialize` replays them after ``fully_shard``, in one of two ways:

- by rows: each rank applies the writes to the rows (dim 0) its shard holds. Only for writes that act
  element by element (``torch.Tag.pointwise``) or overwrite without reading (random fills, ``fill_``,
  ``zero_``), on whole rows, with no tensor operand but 0-dim ones. This is what keeps memory at 1/N. (A shard
  that a rowwise tensor-parallel split also cuts by columns is replayed on its whole rows, then its columns are
  copied out: the values of a row do not depend on how the parameter is split.)
- in full: the whole parameter on a temporary, then the shard copied out. Everything else: ``cumsum_``,
  ``index_put_``, a column view. A parameter that depends on values each rank computed for itself (a
  tensor operand, values it was created with, or construction code that read it) is built on every rank
  and broadcast from rank 0, as DDP starts every rank from rank 0's module.

Every random write draws from a generator of its own, seeded from rank 0's seed, the write's creation
order and the first row it writes on the shard: shards differ from each other, replicas (hybrid
sharding) agree, and a deep copy of a parameter (``nn.TransformerEncoder`` copies its layer) replays to
the same values as its source, as an eager deep copy holds them. A ``generator=`` the user passed to a
random write is replaced by the write's own generator: the distribution is the user's, the stream is not.
"""

from __future__ import annotations

import hashlib
import itertools
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from fsdp_strategy._compat import op_arguments, tensor_version, tree_unflatten
from fsdp_strategy.checkpoint.pretrained import local_region
from fsdp_strategy.sharding.policy import class_name

__all__ = ["OVERWRITES", "DeferredInitError", "Record", "Write", "has_meta_tensors", "materialize"]

aten = torch.ops.aten

# In-place ops that replace every element they write without reading it. On rows they are replayed row
# by row (``copy_`` only ever with a 0-dim source there); on the whole parameter they make what came
# before irrelevant.
OVERWRITES = {
    aten.uniform_.default, aten.normal_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
    aten.copy_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.exponential_.default, aten.geometric_.default,
    aten.log_normal_.default, aten.cauchy_.default, aten.random_.default, getattr(aten.random_, "from"),
    aten.random_.to,
}  # fmt: skip

RECORD_ATTRIBUTE = "_fsdp_strategy_deferred"

_creation_order = itertools.count()  # one per process: every rank builds the same modules in the same order


class DeferredInitError(RuntimeError):
    """Parameters on the meta device that the strategy cannot initialize as the user's code would."""


@dataclass(eq=False)
class Write:
    """One recorded in-place op: ``op`` applied to the view ``(size, stride, offset)`` of the parameter,
    the view standing at position ``target`` of the op's flattened ``(args, kwargs)``."""

    op: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    target: int
    leaves: list[Any]
    spec: Any
    key: int = field(default_factory=lambda: next(_creation_order))
    versions: list[int | None] = field(init=False)  # of the tensor operands, which must not change until replayed

    def __post_init__(self) -> None:
        self.versions = [tensor_version(leaf) if isinstance(leaf, Tensor) else None for leaf in self.leaves]

    @property
    def random(self) -> bool:
        return any(argument.name == "generator" for argument in op_arguments(self.op))

    @property
    def by_rows(self) -> bool:
        """Whether the op, on a block of rows, writes each row from that row alone."""
        return self.op in OVERWRITES or torch.Tag.pointwise in self.op.tags

    @property
    def tensor_operands(self) -> bool:
        return any(isinstance(leaf, Tensor) and leaf.dim() > 0 for leaf in self.leaves)

    def apply(self, view: Tensor, seed: int | None, owner: str, shard: int = 0) -> None:
        """``seed``: rank 0's seed, to draw random values from this write's own generator; ``None`` during
        construction, where the write draws as it was called (the global generator, or the user's)."""
        if any(v is not None and tensor_version(leaf) != v for leaf, v in zip(self.leaves, self.versions)):
            raise DeferredInitError(
                f"A tensor that `{self.op}` wrote into {owner} during construction was modified in place afterwards,"
                " so the values it gave are gone. Write from a tensor that is not changed later (`.clone()` it),"
                " or build this module eagerly."
            )
        leaves = [view if i == self.target else leaf for i, leaf in enumerate(self.leaves)]
        args, kwargs = tree_unflatten(leaves, self.spec)
        if seed is not None and self.random:
            kwargs = {
                **kwargs,
                "generator": torch.Generator(device=view.device).manual_seed(_mix(seed, self.key, shard)),
            }
        self.op(*args, **kwargs)

    def describe(self) -> tuple:
        scalars = [
            repr(leaf.item() if leaf.dim() == 0 else tuple(leaf.shape)) if isinstance(leaf, Tensor) else repr(leaf)
            for leaf in self.leaves
            if not isinstance(leaf, torch.Generator)
        ]
        return str(self.op), self.size, self.stride, self.offset, self.key, scalars


@dataclass(eq=False)
class Record:
    """How one parameter built under ``deferred_init`` gets its values."""

    owner: str  # "Linear.weight": the module class and attribute, for messages
    device: torch.device
    shadow: Tensor  # a meta tensor with the parameter's geometry; views of it give views' geometry
    initial: Tensor | None = None  # the values it was created with, while a later write may still read them
    base: Record | None = None  # or: another record's values (a copy of it), converted to this dtype
    writes: list[Write] = field(default_factory=list)
    full: Tensor | None = None  # set when the construction read the parameter, so it was built in full

    def fork(self) -> Record:
        """A record that replays to the same values as this one does now, and goes on on its own."""
        full = None if self.full is None else self.full.clone()
        return Record(self.owner, self.device, self.shadow, self.initial, self.base, list(self.writes), full)

    def is_whole(self, view: Tensor) -> bool:
        shadow = self.shadow
        geometry = (view.shape, view.stride(), view.storage_offset())
        return geometry == (shadow.shape, shadow.stride(), shadow.storage_offset())

    def start_over(self) -> None:
        """Called before a write that overwrites the whole parameter: what came before no longer matters."""
        self.initial, self.base = None, None
        self.writes.clear()

    def build_now(self) -> None:
        """Builds the parameter in full, as the construction reads it."""
        if self.full is None:
            self.full = self.build_full(None)
            self.start_over()

    def rows_written(self, write: Write) -> tuple[int, int, bool] | None:
        """``(first, end, single)`` when ``write`` covers whole rows (dim 0) of the parameter: all of it, a
        block of rows (``w[2:5]``), or one row (``w[pad]``, ``single``); ``None`` for any other view."""
        shape, stride = tuple(self.shadow.shape), self.shadow.stride()
        if not shape or self.shadow.storage_offset() != 0 or stride[0] == 0 or write.offset % stride[0]:
            return None
        first = write.offset // stride[0]
        if write.size[1:] == shape[1:] and write.stride == stride and len(write.size) == len(shape):
            return first, first + write.size[0], False
        if write.size == shape[1:] and write.stride == stride[1:]:
            return first, first + 1, True
        return None

    def by_rows(self) -> bool:
        """Whether each rank can build its rows alone (see the module docstring)."""
        if self.needs_broadcast() or (self.base is not None and not self.base.by_rows()):
            return False
        return all(write.by_rows and self.rows_written(write) is not None for write in self.writes)

    def needs_broadcast(self) -> bool:
        """Whether the values depend on tensors each rank computed for itself."""
        if self.full is not None or self.initial is not None or any(w.tensor_operands for w in self.writes):
            return True
        return self.base is not None and self.base.needs_broadcast()

    def digest(self) -> int:
        """Differs between ranks that recorded different writes, or writes with other scalar operands."""
        parts = [self.full is not None, self.initial is not None, self.base and self.base.digest()]
        parts += [write.describe() for write in self.writes]
        return zlib.crc32(repr(parts).encode())

    def build_full(self, seed: int | None) -> Tensor:
        """The whole parameter: its starting values, then every recorded write replayed in order."""
        if self.full is not None:
            return self.full
        full = torch.empty_strided(self.shadow.shape, self.shadow.stride(), dtype=self.shadow.dtype, device=self.device)
        if self.base is not None:
            full.copy_(self.base.build_full(seed))
        elif self.initial is not None:
            full.copy_(self.initial)
        for write in self.writes:
            write.apply(full.as_strided(write.size, write.stride, write.offset), seed, self.owner)
        return full

    def replay_rows(self, out: Tensor, start: int, end: int, seed: int) -> Tensor:
        """Writes rows ``start:end`` of the parameter into ``out`` (only when :meth:`by_rows`)."""
        if self.base is not None:
            base = torch.empty(out.shape, dtype=self.base.shadow.dtype, device=out.device)
            out.copy_(self.base.replay_rows(base, start, end, seed))
        for write in self.writes:
            first, last, single = self.rows_written(write)  # type: ignore[misc]
            low, high = max(first, start), min(last, end)
            if low < high:
                write.apply(out[low - start] if single else out[low - start : high - start], seed, self.owner, low + 1)
        return out


def _mix(seed: int, key: int, shard: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{key}/{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63 - 1)


# --- materialization ----------------------------------------------------------------------------------


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialize(model: nn.Module, device: torch.device, records: dict[str, Record]) -> None:
    """Allocates ``model``'s meta tensors on ``device`` (each rank only its shards) and fills them:
    recorded parameters by replaying their writes, the others with their modules' ``reset_parameters()``.
    Tensors that were not on the meta device keep their values.

    Raises:
        DeferredInitError: before anything is allocated, for meta buffers (their values are lost) and for
            unrecorded meta parameters whose module has no ``reset_parameters()``; during the replay, for a
            tensor that a parameter copied from and that was modified afterwards.
    """
    if not has_meta_tensors(model):
        return
    _refuse_what_cannot_be_initialized(model, records)
    with torch.no_grad():
        # to_empty() replaces every tensor, real ones too; the old ones (their shards) are copied back.
        kept = {name: _local(t) for name, t in _named_tensors(model) if not t.is_meta}
        meta_names = {name for name, param in model.named_parameters() if param.is_meta}  # a tied one once
        model.to_empty(device=device)
        via = next((record.device for record in records.values()), device)  # where the model was built
        seed, broadcast = _plan(records, via)
        reset: set[int] = set()
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                if name not in meta_names:
                    continue
                if name in records:
                    _fill(param, records[name], seed=seed, broadcast=name in broadcast, via=via)
                elif id(module) not in reset:
                    module.reset_parameters()  # type: ignore[operator]
                    reset.add(id(module))
        for name, tensor in _named_tensors(model):  # after reset_parameters(), which may write real ones too
            if name in kept:
                _local(tensor).copy_(kept[name])


def _named_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _refuse_what_cannot_be_initialized(model: nn.Module, records: dict[str, Record]) -> None:
    problems = [f"buffer '{name}'" for name, buffer in model.named_buffers() if buffer.is_meta]
    seen: set[int] = set()  # a tied parameter under its first name, as named_parameters() gives it
    for module_name, module in model.named_modules():
        unrecorded = []
        for name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{name}" if module_name else name
            if id(param) not in seen and param.is_meta and name not in records:
                unrecorded.append(name)
            seen.add(id(param))
        if unrecorded and not callable(getattr(module, "reset_parameters", None)):
            problems.append(
                f"parameters {', '.join(repr(n) for n in unrecorded)} ({class_name(module)}, no reset_parameters())"
            )
    if problems:
        raise DeferredInitError(
            "These tensors are on the meta device and the strategy cannot give them the values your code would:"
            f" {'; '.join(problems)}. They were created on the meta device outside `Trainer.init_module(empty_init=True)`"
            " (e.g. under your own `torch.device('meta')`), so how they were initialized is unknown. Build the model"
            " under `trainer.init_module(empty_init=True)` (or with `FSDP2Strategy(meta_init=True)` in"
            " `configure_model`) instead, or build it eagerly, or give each such module a `reset_parameters()`."
        )


def _plan(records: dict[str, Record], via: torch.device) -> tuple[int, set[str]]:
    """Rank 0's seed, and the records to build in full and broadcast: those that need it on any rank,
    and those that ranks recorded differently. One collective, so that every rank decides the same."""
    if not records:  # a model the user put on the meta device: nothing to agree on
        return 0, set()
    names = sorted(records)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    values = [torch.initial_seed() % 2**62 if rank == 0 else 0]
    for name in names:
        record = records[name]
        digest = record.digest()
        values += [int(record.needs_broadcast()), digest, -digest]
    plan = torch.tensor(values, dtype=torch.int64, device=via)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(plan, op=dist.ReduceOp.MAX)
    flags = plan[1:].view(-1, 3).tolist()
    broadcast = {name for name, (needed, high, low) in zip(names, flags) if needed or high != -low}
    return int(plan[0]), broadcast


def _fill(param: Tensor, record: Record, *, seed: int, broadcast: bool, via: torch.device) -> None:
    """Writes this rank's part of a recorded parameter into ``param`` (a DTensor shard or a plain tensor)."""
    local, region = _local(param), local_region(param)
    if isinstance(param, DTensor) and param.dim() and not broadcast and record.by_rows():
        rows, columns = region[0], region[1:]
        if all(cut == slice(0, size) for cut, size in zip(columns, param.shape[1:])):
            record.replay_rows(local, rows.start, rows.stop, seed)
        else:  # a rowwise tensor-parallel split also cuts columns: this rank's rows whole, then its columns
            whole_rows = local.new_empty((rows.stop - rows.start, *param.shape[1:]))
            local.copy_(record.replay_rows(whole_rows, rows.start, rows.stop, seed)[(slice(None), *columns)])
        return
    full = record.build_full(seed)
    if broadcast:
        full = _from_rank_zero(full, via)
    local.copy_(full[region])


def _from_rank_zero(tensor: Tensor, via: torch.device) -> Tensor:
    """Rank 0's values on every rank, as DDP starts every rank from rank 0's module."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.to(device=via, memory_format=torch.contiguous_format, copy=True)
        dist.broadcast(tensor, src=0)
    return tensor
