"""Building a model without allocating its parameters, then initializing each rank's shards as an eager build would.

:func:`deferred_init` is the context behind ``Trainer.init_module(empty_init=True)`` (and ``meta_init=True``).
Inside it the model's code runs for real, on the real device, with one difference: every parameter it
registers becomes a :class:`DeferredTensor`, which has the parameter's shape, dtype and device but no
memory, and which records the in-place writes that initialize it (``uniform_`` from ``reset_parameters``,
Hugging Face's ``normal_`` in ``_init_weights``, ``load_state_dict``'s ``copy_``, a padding row's
``zero_``). Buffers are ordinary tensors, so the values ``__init__`` computes for them (a rotary
embedding's ``inv_freq``) are exactly those of an eager build. When the construction reads a
parameter's values (``trunc_normal_``'s rejection loop, ``orthogonal_``'s QR), that one parameter is
built in full right there, as eagerly, and the construction goes on. When the context ends, the
parameters become meta tensors that carry their record.

After sharding, :func:`materialize` replays each parameter's writes on this rank's shard: the same
initialization scheme, at 1/N of the memory and compute. Random writes on a shard draw from a generator
of their own per parameter and shard, so shards differ from each other and replicas (hybrid sharding)
agree. A write that does not cover whole rows is replayed on a full-size temporary of that one
parameter, from which the shard is copied.

Parameters that arrive on the meta device from elsewhere (a model built under the user's own
``torch.device("meta")``) carry no record: they are initialized with their modules'
``reset_parameters()``, and a module that has none is an error before training, never a guess.
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.nn.modules.module import register_module_parameter_registration_hook
from fsdp_strategy._compat import disabled_torch_function_impl, make_wrapper_subclass, tree_flatten, tree_map, tree_unflatten
from fsdp_strategy.policy import class_name

__all__ = ["DeferredInitError", "DeferredTensor", "deferred_init", "has_meta_tensors", "materialize"]

aten = torch.ops.aten

# In-place ops that replace every element they write without reading it: after one of them on the whole
# parameter, the values the parameter was created with no longer matter.
_OVERWRITES = {
    aten.uniform_.default, aten.normal_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
    aten.copy_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.exponential_.default,
    aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default, aten.random_.default,
    getattr(aten.random_, "from"), aten.random_.to,
}  # fmt: skip

# Ops that take a tensor only for its dtype and device (and, for *_like, its shape): they read no values.
_FACTORIES_FROM_METADATA = {
    aten.new_empty.default, aten.new_empty_strided.default, aten.new_zeros.default, aten.new_ones.default,
    aten.new_full.default, aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
    aten.randint_like.low_dtype,
}  # fmt: skip

_RECORD_ATTRIBUTE = "_fsdp_strategy_deferred"


class DeferredInitError(RuntimeError):
    """Parameters on the meta device that the strategy cannot initialize as the user's code would."""


@dataclass(eq=False)
class _Write:
    """One recorded in-place op: ``op`` applied to the view ``(size, stride, offset)`` of the parameter,
    the view standing at position ``target`` of the op's flattened ``(args, kwargs)``."""

    op: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    target: int
    leaves: list[Any]
    spec: Any

    def apply(self, view: Tensor, generator: torch.Generator | None, operand_rows: slice | None = None) -> None:
        """``operand_rows``: the rows of the written view that ``view`` holds, so that tensor operands
        spanning those rows are cut to match (others broadcast as they did)."""
        leaves = [view if i == self.target else self._cut(leaf, operand_rows) for i, leaf in enumerate(self.leaves)]
        args, kwargs = tree_unflatten(leaves, self.spec)
        if any(argument.name == "generator" for argument in self.op._schema.arguments):
            kwargs = {**kwargs, "generator": generator}
        self.op(*args, **kwargs)

    def _cut(self, leaf: Any, rows: slice | None) -> Any:
        if rows is None or not isinstance(leaf, Tensor) or leaf.dim() != len(self.size) or leaf.shape[0] == 1:
            return leaf
        return leaf[rows]


@dataclass(eq=False)
class _Record:
    """How one parameter built under :func:`deferred_init` gets its values."""

    owner: str  # "Linear.weight": the module class and attribute, for messages
    device: torch.device
    shadow: Tensor  # a meta tensor with the parameter's geometry; views of it give views' geometry
    initial: Tensor | None  # the values it was created with, while a later write may still read them
    writes: list[_Write] = field(default_factory=list)
    full: Tensor | None = None  # set when the construction read the parameter, so it was built in full

    def is_whole(self, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> bool:
        shadow = self.shadow
        return size == tuple(shadow.shape) and stride == shadow.stride() and offset == shadow.storage_offset()

    def rows_written(self, write: _Write) -> tuple[int, int, bool] | None:
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

    def build_full(self, generator: torch.Generator | None) -> Tensor:
        """The whole parameter: its initial values, then every recorded write replayed in order."""
        if self.full is not None:
            return self.full
        full = torch.empty_strided(self.shadow.shape, self.shadow.stride(), dtype=self.shadow.dtype, device=self.device)
        if self.initial is not None:
            full.copy_(self.initial)
        for write in self.writes:
            write.apply(full.as_strided(write.size, write.stride, write.offset), generator)
        return full


class DeferredTensor(torch.Tensor):
    """A parameter under construction: real shape, dtype and device, no memory; in-place writes are recorded."""

    _record: _Record
    _shadow: Tensor

    # Every op reaches __torch_dispatch__: there is no Python-level behaviour to keep.
    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shadow: Tensor, record: _Record) -> DeferredTensor:
        tensor = make_wrapper_subclass(cls, shadow, device=record.device)
        tensor._shadow = shadow
        tensor._record = record
        return tensor

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"DeferredTensor({self._record.owner}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        written = _written_positions(func, args, kwargs, leaves)
        pending = [i for i, leaf in enumerate(leaves) if isinstance(leaf, DeferredTensor) and leaf._record.full is None]
        if pending:
            if func.is_view and pending == [0] and not written:
                record = leaves[0]._record
                out = func(*tree_map(_shadow_of, args), **tree_map(_shadow_of, kwargs))
                return tree_map(lambda t: DeferredTensor(t, record) if isinstance(t, Tensor) else t, out)
            if func in _FACTORIES_FROM_METADATA:
                return func(*tree_map(_stand_in, args), **tree_map(_stand_in, kwargs))
            if written == pending and len(written) == 1:
                return _record_write(func, args, kwargs, leaves, spec, written[0])
            # The construction reads these parameters: build each in full, as an eager build holds it.
            for i in pending:
                record = leaves[i]._record
                record.full = record.build_full(None)
                record.writes.clear()
                record.initial = None
        out = func(*tree_map(_real_view, args), **tree_map(_real_view, kwargs))
        # An in-place op returns the tensor it wrote: hand out the parameter, not a view of its memory.
        return leaves[written[0]] if written else out


def _written_positions(func: Any, args: tuple, kwargs: dict, leaves: list[Any]) -> list[int]:
    written = set()
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, DeferredTensor):
            written.add(id(value))
    return [i for i, leaf in enumerate(leaves) if id(leaf) in written]


def _record_write(func: Any, args: tuple, kwargs: dict, leaves: list[Any], spec: Any, position: int) -> Any:
    target: DeferredTensor = leaves[position]
    record = target._record
    # Run on the geometry alone, so that a wrong shape or dtype fails here as it would eagerly.
    func(*tree_map(_shadow_of, args), **tree_map(_shadow_of, kwargs))
    shadow = target._shadow
    size, stride, offset = tuple(shadow.shape), shadow.stride(), shadow.storage_offset()
    if func in _OVERWRITES and record.is_whole(size, stride, offset):
        record.writes.clear()
        record.initial = None
    kept = [None if i == position else leaf for i, leaf in enumerate(leaves)]
    record.writes.append(_Write(func, size, stride, offset, position, kept, spec))
    return target


def _shadow_of(value: Any) -> Any:
    return value._shadow if isinstance(value, DeferredTensor) else value


def _real_view(value: Any) -> Any:
    if not isinstance(value, DeferredTensor):
        return value
    shadow, full = value._shadow, value._record.full
    return full.as_strided(shadow.shape, shadow.stride(), shadow.storage_offset())  # type: ignore[union-attr]


def _stand_in(value: Any) -> Any:
    if not isinstance(value, DeferredTensor):
        return value
    # Memory of the tensor's size that is never written: *_like ops need the shape, the others dtype and device.
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


# --- construction -----------------------------------------------------------------------------------


@contextmanager
def deferred_init(device: torch.device) -> Iterator[None]:
    """Builds modules on ``device`` with every parameter deferred (see the module docstring).

    When the context ends, each deferred parameter is replaced by a meta tensor that carries its record,
    ready for ``fully_shard`` and :func:`materialize`. Buffers stay as they were computed.
    """
    owners: list[weakref.ref[nn.Module]] = []

    def defer(module: nn.Module, name: str, param: Tensor | None) -> Tensor | None:
        owners.append(weakref.ref(module))
        # A subclass of Parameter (a lazy or quantized one) keeps its own way of being built.
        if param is None or isinstance(param, DeferredTensor) or param.is_meta or type(param) is not nn.Parameter:
            return None
        shadow = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device="meta")
        record = _Record(owner=f"{class_name(module)}.{name}", device=param.device, shadow=shadow, initial=param.detach())
        return nn.Parameter(DeferredTensor(shadow, record), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(defer)
    try:
        with torch.device(device):
            yield
    finally:
        handle.remove()
        _to_meta({id(m): m for ref in owners if (m := ref()) is not None}.values())


def _to_meta(modules: Any) -> None:
    """Swaps every deferred parameter for a meta parameter carrying its record (tied ones stay tied)."""
    replacements: dict[int, nn.Parameter] = {}
    for module in modules:
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DeferredTensor):
                continue
            if id(param) not in replacements:
                meta = nn.Parameter(torch.empty_like(param._shadow), requires_grad=param.requires_grad)
                setattr(meta, _RECORD_ATTRIBUTE, param._record)
                replacements[id(param)] = meta
            setattr(module, name, replacements[id(param)])
        for name, buffer in list(module._buffers.items()):
            if isinstance(buffer, DeferredTensor):  # a buffer made from a parameter needs its values now
                record = buffer._record
                record.full = record.build_full(None)
                module._buffers[name] = _real_view(buffer).clone()


# --- materialization ----------------------------------------------------------------------------------


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def records_by_name(model: nn.Module) -> dict[str, _Record]:
    """The records of ``model``'s deferred parameters, by name, taken before ``fully_shard`` replaces them."""
    # Taken off the parameters: a record holds the tensors its writes copy from (a loaded state dict).
    return {
        name: record
        for name, param in model.named_parameters()
        if (record := param.__dict__.pop(_RECORD_ATTRIBUTE, None)) is not None
    }


def materialize(model: nn.Module, device: torch.device, records: dict[str, _Record]) -> None:
    """Allocates ``model``'s meta tensors on ``device`` (each rank only its shards) and fills them:
    recorded parameters by replaying their writes, the others with their modules' ``reset_parameters()``.

    Raises:
        DeferredInitError: before anything is allocated, for meta buffers (their values are lost) and for
            unrecorded meta parameters whose module has no ``reset_parameters()``.
    """
    if not has_meta_tensors(model):
        return
    _refuse_what_cannot_be_initialized(model, records)
    buffers = {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}
    meta_names = {name for name, param in model.named_parameters() if param.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():  # to_empty() leaves every tensor uninitialized
            if name in buffers:
                buffer.copy_(buffers[name])
        seed = _shared_seed()
        reset: set[int] = set()
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                if name not in meta_names:
                    continue
                if name in records:
                    _fill(param, records[name], seed=_mix(seed, name))
                elif id(module) not in reset:
                    module.reset_parameters()  # type: ignore[operator]
                    reset.add(id(module))


def _refuse_what_cannot_be_initialized(model: nn.Module, records: dict[str, _Record]) -> None:
    problems = [f"buffer '{name}'" for name, buffer in model.named_buffers() if buffer.is_meta]
    for module_name, module in model.named_modules():
        unrecorded = [
            f"{module_name}.{name}" if module_name else name
            for name, param in module.named_parameters(recurse=False)
            if param.is_meta and (f"{module_name}.{name}" if module_name else name) not in records
        ]
        if unrecorded and not callable(getattr(module, "reset_parameters", None)):
            problems.append(f"parameters {', '.join(repr(n) for n in unrecorded)} ({class_name(module)}, no reset_parameters())")
    if problems:
        raise DeferredInitError(
            "These tensors are on the meta device and the strategy cannot give them the values your code would:"
            f" {'; '.join(problems)}. They were created on the meta device outside `Trainer.init_module(empty_init=True)`"
            " (e.g. under your own `torch.device('meta')`), so how they were initialized is unknown. Build the model"
            " under `trainer.init_module(empty_init=True)` (or with `FSDP2Strategy(meta_init=True)` in"
            " `configure_model`) instead, or build it eagerly, or give each such module a `reset_parameters()`."
        )


def _shared_seed() -> int:
    """Rank 0's seed, so that every rank derives the same per-parameter generators."""
    box = [torch.initial_seed()]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _mix(seed: int, name: str, shard: int = 0) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 7_919 + shard) % (2**63 - 1)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _fill(param: Tensor, record: _Record, *, seed: int) -> None:
    """Writes this rank's part of a recorded parameter into ``param`` (a DTensor shard or a plain tensor)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    rows = _local_rows(param)
    by_rows = rows is not None and record.full is None and all(record.rows_written(w) is not None for w in record.writes)
    if by_rows:
        start, end = rows  # type: ignore[misc]
        generator = _generator(local.device, _mix(seed, "", start + 1))
        if record.initial is not None:
            local.copy_(_consistent(record.initial)[start:end])
        for write in record.writes:
            first, last, single = record.rows_written(write)  # type: ignore[misc]
            low, high = max(first, start), min(last, end)
            if low >= high:
                continue
            view = local[low - start] if single else local[low - start : high - start]
            write.apply(view, generator, None if single else slice(low - first, high - first))
        return
    full = record.build_full(_generator(record.device, seed))
    if record.full is not None or record.initial is not None:
        full = _consistent(full)  # built from values that may differ by rank without a common seed
    if rows is None:
        local.copy_(full)
    else:
        local.copy_(full[rows[0] : rows[1]])


def _consistent(tensor: Tensor) -> Tensor:
    """Rank 0's values on every rank, as DDP starts every rank from rank 0's module."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.broadcast(tensor, src=0)
    return tensor


def _local_rows(param: Tensor) -> tuple[int, int] | None:
    """The rows (dim 0) of the full parameter that this rank's shard holds; ``None`` for a whole tensor.

    FSDP2 shards dim 0 as ``torch.chunk`` does: chunks of ``ceil(rows / n)``, the last ones short or empty.
    """
    if not isinstance(param, DTensor):
        return None
    start, size = 0, param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if not isinstance(placement, Shard):
            continue
        if placement.dim != 0:
            raise DeferredInitError(f"Cannot initialize a parameter sharded on dim {placement.dim}; only dim 0 is supported.")
        count, index = param.device_mesh.size(mesh_dim), param.device_mesh.get_local_rank(mesh_dim)
        chunk = math.ceil(size / count)
        start, size = start + index * chunk, max(0, min(chunk, size - index * chunk))
    return start, start + size
