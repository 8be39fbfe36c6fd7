"""Building a model without allocating its parameters, then initializing each rank's shards as an eager build would.

:func:`deferred_init` is the context behind ``Trainer.init_module(empty_init=True)`` (and ``meta_init=True``).
Inside it the model's code runs for real, on the real device, with one difference: every parameter it
registers becomes a :class:`DeferredTensor`, which has the parameter's shape, dtype and device but no
memory, and which records the in-place writes that initialize it (``uniform_`` from ``reset_parameters``,
Hugging Face's ``normal_`` in ``_init_weights``, ``load_state_dict``'s ``copy_``, a padding row's
``zero_``). Buffers are ordinary tensors, so the values ``__init__`` computes for them (a rotary
embedding's ``inv_freq``) are exactly those of an eager build. What an eager build does to a parameter
beyond writes is followed too: ``param.data = tensor``, conversions (``module.half()``), deep copies
(``nn.TransformerEncoder`` copies its layer), one ``nn.Parameter`` assigned to two modules (tied).

When the construction reads a parameter's values (``trunc_normal_``'s rejection loop, a value computed
from it), or does what cannot be recorded (an ``out=`` op, ``t_()``, an op meta tensors cannot run), that
one parameter is built in full right there, as eagerly, and the construction goes on. (``orthogonal_``
reads nothing: it copies a matrix computed from a random one, which is recorded as that ``copy_``.)
When the context ends, the parameters become meta tensors that carry their record, which
:func:`~fsdp_strategy.sharding.deferred_replay.materialize` replays on each rank's shard after ``fully_shard``
(see :mod:`fsdp_strategy.sharding.deferred_replay`).

Parameters that arrive on the meta device from elsewhere (a model built under the user's own
``torch.device("meta")``) carry no record: they are initialized with their modules'
``reset_parameters()``, and a module that has none is an error before training, never a guess.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from fsdp_strategy._compat import (
    disabled_torch_function_impl,
    make_wrapper_subclass,
    op_arguments,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from fsdp_strategy.sharding.deferred_replay import (
    OVERWRITES,
    RECORD_ATTRIBUTE,
    DeferredInitError,
    Record,
    Write,
    has_meta_tensors,
    materialize,
)
from fsdp_strategy.sharding.policy import class_name

__all__ = ["DeferredInitError", "DeferredTensor", "deferred_init", "has_meta_tensors", "materialize", "records_by_name"]

aten = torch.ops.aten

# Ops that take a tensor only for its dtype and device: they read no values and need no memory of its size.
_NEW_FACTORIES = {
    aten.new_empty.default, aten.new_empty_strided.default, aten.new_zeros.default, aten.new_ones.default,
    aten.new_full.default,
}  # fmt: skip
# These also take its shape (and strides).
_LIKE_FACTORIES = {
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
}  # fmt: skip
# A copy of a whole deferred tensor is deferred too: its record starts from the source's values.
_COPIES = {aten.clone.default, aten._to_copy.default}


class DeferredTensor(torch.Tensor):
    """A parameter under construction: real shape, dtype and device, no memory; in-place writes are recorded."""

    _record: Record
    _shadow: Tensor

    # Every op reaches __torch_dispatch__: there is no Python-level behaviour to keep.
    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shadow: Tensor, record: Record) -> DeferredTensor:
        tensor = make_wrapper_subclass(cls, shadow, device=record.device)
        tensor._shadow = shadow
        tensor._record = record
        return tensor

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"DeferredTensor({self._record.owner}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"
        )

    @property  # type: ignore[override]
    def data(self) -> Tensor:
        return torch.Tensor.data.__get__(self)  # a DeferredTensor of the same record (aten.detach)

    @data.setter
    def data(self, value: Tensor) -> None:
        _adopt(self, value)

    def __deepcopy__(self, memo: dict) -> Tensor:
        if id(self) in memo:
            return memo[id(self)]
        record = self._record
        if record.full is None and record.is_whole(self._shadow):
            duplicate = DeferredTensor(self._shadow, record.fork())
        else:
            duplicate = _deferred_from(_built(self).clone(), record.owner)
        if isinstance(self, nn.Parameter):
            duplicate = nn.Parameter(duplicate, requires_grad=self.requires_grad)
        memo[id(self)] = duplicate
        for name, value in self.__dict__.items():
            if name not in ("_record", "_shadow", "_is_param"):
                setattr(duplicate, name, copy.deepcopy(value, memo))
        return duplicate

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        written, into_out = _written_positions(func, args, kwargs, leaves)
        pending = [i for i, leaf in enumerate(leaves) if isinstance(leaf, DeferredTensor) and leaf._record.full is None]
        changes_geometry = torch.Tag.inplace_view in func.tags and func is not aten.detach_.default
        if pending:
            first: DeferredTensor = leaves[pending[0]]
            if func.is_view and pending == [0] and not written:
                out = func(*tree_map(_shadow_of, args), **tree_map(_shadow_of, kwargs))
                return tree_map(lambda t: DeferredTensor(t, first._record) if isinstance(t, Tensor) else t, out)
            if func is aten.detach_.default and pending == [0]:
                return first
            if func in _NEW_FACTORIES or func in _LIKE_FACTORIES:
                return func(*tree_map(_stand_in(func), args), **tree_map(_stand_in(func), kwargs))
            if func in _COPIES and pending == [0] and first._record.is_whole(first._shadow):
                if (copied := _deferred_copy(func, first, kwargs)) is not None:
                    return copied
            if written == pending and len(written) == 1 and not into_out and not changes_geometry:
                if _record_write(func, args, kwargs, leaves, spec, written[0]):
                    return first
            # The construction reads these parameters, or does what cannot be recorded: build each in full.
            for i in pending:
                leaves[i]._record.build_now()
        real = [_real_view(leaf) for leaf in leaves]
        real_args, real_kwargs = tree_unflatten(real, spec)
        out = func(*real_args, **real_kwargs)
        if not written:
            return out
        target = leaves[written[0]]
        if changes_geometry:  # t_(), resize_(): the tensor itself now has the view's shape
            _adopt(target, real[written[0]])
        # An in-place op returns the tensor it wrote: hand out the parameter, not a view of its memory.
        return target


def _written_positions(func: Any, args: tuple, kwargs: dict, leaves: list[Any]) -> tuple[list[int], bool]:
    """The positions in ``leaves`` of the deferred tensors ``func`` writes, and whether one is an ``out=``."""
    written, into_out = set(), False
    for position, argument in enumerate(op_arguments(func)):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, DeferredTensor):
            written.add(id(value))
            into_out = into_out or argument.is_out
    return [i for i, leaf in enumerate(leaves) if id(leaf) in written], into_out


def _record_write(func: Any, args: tuple, kwargs: dict, leaves: list[Any], spec: Any, position: int) -> bool:
    """Records an in-place write to one deferred tensor; ``False`` when the op cannot run on meta tensors."""
    target: DeferredTensor = leaves[position]
    record = target._record
    # Run on the geometry alone, so that a wrong shape or dtype fails here as it would eagerly.
    try:
        dry_kwargs = {name: value for name, value in kwargs.items() if name != "generator"}
        func(*tree_map(_meta_of, args), **tree_map(_meta_of, dry_kwargs))
    except Exception:  # noqa: BLE001 - an op meta tensors cannot run (data-dependent): done for real instead
        return False
    shadow = target._shadow
    if func in OVERWRITES and record.is_whole(shadow):
        record.start_over()
    kept = [None if i == position else leaf for i, leaf in enumerate(leaves)]
    record.writes.append(
        Write(func, tuple(shadow.shape), shadow.stride(), shadow.storage_offset(), position, kept, spec)
    )
    return True


def _deferred_copy(func: Any, source: DeferredTensor, kwargs: dict) -> DeferredTensor | None:
    """``source.clone()``, ``source.half()``, ``source.to(device)``: a record starting from a copy of its values."""
    if kwargs.get("layout") not in (None, torch.strided):
        return None
    device = torch.device(kwargs.get("device") or source.device)
    if device.type == "meta":
        return None
    geometry = {name: value for name, value in kwargs.items() if name not in ("device", "pin_memory", "non_blocking")}
    shadow = func(source._shadow, **geometry)
    return DeferredTensor(shadow, Record(source._record.owner, device, shadow, base=source._record.fork()))


def _deferred_from(values: Tensor, owner: str) -> DeferredTensor:
    """A deferred tensor that starts from ``values`` (kept, not copied, as a parameter keeps its data)."""
    shadow = torch.empty_strided(values.shape, values.stride(), dtype=values.dtype, device="meta")
    return DeferredTensor(shadow, Record(owner, values.device, shadow, initial=values))


def _adopt(tensor: DeferredTensor, value: Tensor) -> None:
    """``tensor.data = value``: ``tensor`` stands for ``value``'s values, shape and dtype from now on."""
    if not isinstance(value, DeferredTensor):
        value = _deferred_from(value.detach(), tensor._record.owner)
    elif not value._record.is_whole(value._shadow):  # a view of another tensor: its own values from now on
        value = _deferred_from(_built(value), tensor._record.owner)
    torch.Tensor.data.__set__(tensor, value)  # the wrapper's shape, strides and dtype
    tensor._shadow, tensor._record = value._shadow, value._record


def _built(tensor: DeferredTensor) -> Tensor:
    tensor._record.build_now()
    return _real_view(tensor)


def _shadow_of(value: Any) -> Any:
    return value._shadow if isinstance(value, DeferredTensor) else value


def _meta_of(value: Any) -> Any:
    if isinstance(value, DeferredTensor):
        return value._shadow
    return value.to("meta") if isinstance(value, Tensor) else value


def _real_view(value: Any) -> Any:
    if not isinstance(value, DeferredTensor):
        return value
    shadow, full = value._shadow, value._record.full
    return full.as_strided(shadow.shape, shadow.stride(), shadow.storage_offset())  # type: ignore[union-attr]


def _stand_in(func: Any) -> Any:
    """Memory that is never written in place of a deferred tensor for a factory op: of the tensor's size
    for ``*_like`` ops (they need its shape), none for ``new_*`` ops (dtype and device only)."""

    def stand_in(value: Any) -> Any:
        if not isinstance(value, DeferredTensor):
            return value
        if func in _NEW_FACTORIES:
            return torch.empty(0, dtype=value.dtype, device=value.device)
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)

    return stand_in


# --- construction -----------------------------------------------------------------------------------


@contextmanager
def deferred_init(device: torch.device) -> Iterator[None]:
    """Builds modules on ``device`` with every parameter deferred (see the module docstring).

    When the context ends, each deferred parameter is replaced by a meta tensor that carries its record,
    ready for ``fully_shard`` and :func:`materialize`. Buffers stay as they were computed.
    """
    owners: list[weakref.ref[nn.Module]] = []
    # The deferred parameter made for each parameter object, so that one object assigned to two modules
    # stays one parameter, tied, as eagerly. Weak: the object a parameter was created as must not keep its
    # memory; an id is only trusted while the object it was taken from is alive.
    made: dict[int, tuple[weakref.ref[Tensor], weakref.ref[Tensor]]] = {}

    def defer(module: nn.Module, name: str, param: Tensor | None) -> Tensor | None:
        owners.append(weakref.ref(module))
        if isinstance(param, DeferredTensor):
            if param._record.is_whole(param._shadow):
                return None
            # nn.Parameter(other[0:2]): a view of another parameter, with values of its own from now on.
            return nn.Parameter(_deferred_from(_built(param), param._record.owner), requires_grad=param.requires_grad)
        # A subclass of Parameter (a lazy or quantized one) keeps its own way of being built.
        if param is None or param.is_meta or type(param) is not nn.Parameter:
            return None
        original, deferred = made.get(id(param), (lambda: None, lambda: None))
        if original() is param and deferred() is not None:
            return deferred()
        deferred_param = nn.Parameter(
            _deferred_from(param.detach(), f"{class_name(module)}.{name}"), requires_grad=param.requires_grad
        )
        made[id(param)] = (weakref.ref(param), weakref.ref(deferred_param))
        return deferred_param

    def track(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        owners.append(weakref.ref(module))  # a deep copy's parameters are found through the module it joins

    handles = [register_module_parameter_registration_hook(defer), register_module_module_registration_hook(track)]
    try:
        with torch.device(device):
            yield
    finally:
        for handle in handles:
            handle.remove()
        made.clear()
        _to_meta([m for ref in owners if (m := ref()) is not None])


def records_by_name(model: nn.Module) -> dict[str, Record]:
    """The records of ``model``'s deferred parameters, by name, taken before ``parallelize_module`` and
    ``fully_shard`` replace the parameters (the names stay)."""
    _to_meta([model])  # deferred parameters the context did not reach: a deep copy kept outside any module
    # Taken off the parameters: a record holds the tensors its writes copy from (a loaded state dict).
    return {
        name: record
        for name, param in model.named_parameters()
        if (record := param.__dict__.pop(RECORD_ATTRIBUTE, None)) is not None
    }


def _to_meta(roots: list[nn.Module]) -> None:
    """Swaps every deferred parameter for a meta parameter carrying its record (tied ones stay tied)."""
    replacements: dict[int, nn.Parameter] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        stack.extend(module.children())
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DeferredTensor):
                continue
            if id(param) not in replacements:
                meta = nn.Parameter(torch.empty_like(param._shadow), requires_grad=param.requires_grad)
                setattr(meta, RECORD_ATTRIBUTE, param._record)
                replacements[id(param)] = meta
            setattr(module, name, replacements[id(param)])
        for name, buffer in list(module._buffers.items()):
            if isinstance(buffer, DeferredTensor):  # a buffer made from a parameter needs its values now
                module._buffers[name] = _built(buffer).clone()
