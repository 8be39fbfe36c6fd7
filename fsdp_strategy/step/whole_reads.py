"""User code in ``training_step`` that reads whole parameters computes with whole parameters, as under DDP.

Outside a unit's forward, ``self.parameters()`` (or ``self.head.weight``) are this rank's shards, DTensors. Code
written for DDP reads them whole: a penalty on the weights added to the loss (``loss + c * sum(p.pow(2).sum() for p
in self.parameters())``), a distance to a plain copy of the pretrained weights, a max-norm constraint applied after
a manual ``opt.step()``. DTensor accepts the penalty's forward but its backward then mixes a DTensor gradient into
the loss's plain graph and fails; a plain tensor of more than one element or an op without a sharding rule
(``torch.renorm``) fails at once. :class:`WholeReads`, a torch function mode around ``training_step``, computes
exactly those ops on whole tensors: each DTensor argument becomes ``full_tensor()`` (an all-reduce for a sum, an
all-gather for a parameter; differentiable, so the penalty's gradient reaches each shard as DDP's reaches the whole
parameter), the op runs on plain tensors, and where it wrote into a DTensor (in place, ``out=``) this rank's rows are
written back; the result of an op without a rule is laid out as its first DTensor argument again. A reduction of
DTensors alone (``p.pow(2).sum()``), which DTensor leaves as each rank's part of a sum still to be taken
(``Partial``), is replicated at once, one all-reduce: its ``item()`` and the value ``self.log`` keeps would be this
rank's part otherwise. Every other op, all of forward included, runs as it would without the mode.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.overrides import TorchFunctionMode

__all__ = ["WholeReads", "explain", "plain_tensors"]


class WholeReads(TorchFunctionMode):
    """Computes on whole tensors the ops of user code that mix DTensors with plain tensors, or that DTensor has no
    sharding rule for (see the module). :meth:`paused` lets an optimizer step inside ``training_step`` (manual
    optimization) run its many ops without the mode looking at each."""

    def __init__(self) -> None:
        super().__init__()
        self._paused = False
        # `p[0]` of a shard is a copy where DDP's is a view of the parameter: a write into it would be lost.
        self._copies: dict[int, weakref.ref[Tensor]] = {}  # by id: a tensor's `==` is elementwise

    @contextmanager
    def active(self) -> Iterator[None]:
        """The mode on, also inside an automatic optimizer step's closure, which runs in :meth:`paused`."""
        paused, self._paused = self._paused, False
        try:
            with self:
                yield
        finally:
            self._paused = paused

    @contextmanager
    def paused(self) -> Iterator[None]:
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    def _is_copy(self, tensor: Tensor) -> bool:
        copy = self._copies.get(id(tensor))
        return copy is not None and copy() is tensor

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self._copies and any(self._is_copy(t) for t in _targets(func, args, kwargs)):
            raise RuntimeError(_LOST_WRITE.format(op=name))
        dtensors, plains = _split(args, kwargs)
        if not dtensors:
            return func(*args, **kwargs)
        if name == "__set__" and isinstance(args[0], DTensor):  # `p.data = value`, `p.grad = value`
            return _assigned(func, args[0], args[1])
        written = _written(func, args, kwargs)
        if name == "__setitem__":  # DTensor writes `p[0] = 0` into a copy, dropped
            return _on_whole(func, args, kwargs, written)
        # A plain scalar without gradient changing a shard in place (`p.mul_(torch.tensor(0.9))`) is a number to
        # DTensor too: the shards change as the whole parameter would.
        # So is the coefficient clip_grad_norm_ multiplies the gradients by (`torch._foreach_mul_(grads, coef)`).
        scalars = all(t.ndim == 0 and not t.requires_grad for t in plains)
        if plains and not (scalars and written):
            return _on_whole(func, args, kwargs, written)
        try:
            result = func(*args, **kwargs)
        except NotImplementedError as error:
            if "sharding strategy" not in str(error):
                raise
            return _on_whole(func, args, kwargs, written, relayout=True)
        if any(_averaged(r) for r in _results(result)):
            # DTensor averages the ranks' means of uneven shards (`F.mse_loss(p, target)`), and its gradient is
            # world-size times too large: computed on the whole tensors instead.
            return _on_whole(func, args, kwargs, written)
        if name == "__getitem__" and _basic_index(args[1]) and not _shares_memory(result, args[0]):
            key = id(result)
            self._copies[key] = weakref.ref(result, lambda _: self._copies.pop(key, None))
        return _settled(result)


_LOST_WRITE = (
    "`{op}` writes into an index of a sharded parameter (`p[0].zero_()`): under FSDP2 that is a copy of rows that"
    " this rank may not hold, where under DDP it is a view of the parameter, so the write would be lost. Assign"
    " instead (`p[0] = 0.0`, `p[0] = p[0] * 0.5`: written into the shards), or change the whole parameter"
    " (`p.mul_(mask)`)."
)


def _basic_index(index: Any) -> bool:
    """An index that makes a view of a plain tensor (ints, slices, ``None``, ``...``), not a copy."""
    items = index if isinstance(index, tuple) else (index,)
    return all(item is None or item is Ellipsis or isinstance(item, (int, slice)) for item in items)


def _shares_memory(result: Any, source: DTensor) -> bool:
    if not isinstance(result, Tensor):
        return True
    local = result.to_local() if isinstance(result, DTensor) else result
    return local.untyped_storage().data_ptr() == source.to_local().untyped_storage().data_ptr()


def _assigned(setter: Any, target: DTensor, value: Any) -> None:
    """``p.data = value`` or ``p.grad = value`` of a sharded parameter: a whole value is laid out as the
    parameter's shards, as DDP's parameter takes all of it."""
    attribute = getattr(getattr(setter, "__self__", None), "__name__", "")
    if value is None or attribute not in ("data", "grad"):
        return setter(target, value)
    if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
        raise RuntimeError(
            f"`p.{attribute} = value` of a sharded parameter of shape {tuple(target.shape)} and {target.dtype} got a"
            f" value of shape {tuple(value.shape)} and {value.dtype}: under FSDP2 only a value of the parameter's own"
            " shape and dtype can be laid out as its shards. Build the model with that shape (in `configure_model`)."
        )
    if attribute == "grad":
        if not isinstance(value, DTensor):
            value = distribute_tensor(value.detach(), target.device_mesh, target.placements, src_data_rank=None)
        return setter(target, value)
    if isinstance(value, DTensor):
        rows = value.redistribute(target.device_mesh, target.placements).to_local()
    else:
        rows = _rows(value, target)
    with torch.no_grad():
        target.to_local().copy_(rows)
    return None


def _results(result: Any) -> list[Any]:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _pending(value: Any) -> bool:
    return isinstance(value, DTensor) and any(placement.is_partial() for placement in value.placements)


def _averaged(value: Any) -> bool:
    return _pending(value) and any(getattr(placement, "reduce_op", None) == "avg" for placement in value.placements)


def _settled(result: Any) -> Any:
    """A reduction over shards (``p.pow(2).sum()``, ``torch.aminmax``, ``torch._foreach_norm``) replicated at once,
    one all-reduce each: DTensor leaves it each rank's part of a reduction still to be taken (``Partial``), whose
    ``item()``, or the value ``self.log`` keeps, is this rank's part alone. Replicated, not plain: dividing a shard by
    it (``p / p.norm()``) stays a DTensor op on the shard."""
    if _pending(result):
        return result.redistribute(placements=[Replicate()] * result.device_mesh.ndim)
    if isinstance(result, (list, tuple)) and any(_pending(r) for r in result):
        settled = [_settled(r) for r in result]
        return settled if isinstance(result, list) else type(result)(settled)  # a tuple, or torch.return_types
    return result


def _tensors(values: Any) -> Iterator[Tensor]:
    for value in values:
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))


def _split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[DTensor], list[Tensor]]:
    dtensors, plains = [], []
    for tensor in _tensors((*args, *kwargs.values())):
        (dtensors if isinstance(tensor, DTensor) else plains).append(tensor)
    return dtensors, plains


def _whole(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, (list, tuple)) and any(isinstance(v, DTensor) for v in value):
        return type(value)(_whole(v) for v in value)
    return value


def _on_whole(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], written: list[DTensor], *, relayout: bool = False
) -> Any:
    whole_args = tuple(_whole(a) for a in args)
    whole_kwargs = {k: _whole(v) for k, v in kwargs.items()}
    result = func(*whole_args, **whole_kwargs)
    if written:
        if isinstance(kwargs.get("out"), DTensor):
            pairs, returned = [(whole_kwargs["out"], kwargs["out"])], kwargs["out"]
        elif isinstance(args[0], DTensor):
            pairs, returned = [(whole_args[0], args[0])], args[0]
        else:  # an in-place foreach op, which returns nothing: the DTensors of its first argument, a list
            pairs = [(whole, target) for whole, target in zip(whole_args[0], args[0]) if isinstance(target, DTensor)]
            returned = result
        for whole, target in pairs:
            target.to_local().copy_(_rows(whole, target))
        return returned
    first = next(t for t in _tensors((*args, *kwargs.values())) if isinstance(t, DTensor))
    if relayout and isinstance(result, Tensor) and result.shape == first.shape:
        return distribute_tensor(result, first.device_mesh, first.placements, src_data_rank=None)
    return result


_IN_PLACE_DUNDERS = ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__setitem__")


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[DTensor]:
    """The DTensors ``func`` writes into: the ``out=`` argument, ``self`` of an in-place method (``p.clamp_``), or
    the DTensors of an in-place foreach op's first list (``torch._foreach_mul_(grads, coef)``)."""
    return [t for t in _targets(func, args, kwargs) if isinstance(t, DTensor)]


def _targets(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    if isinstance(kwargs.get("out"), Tensor):
        return [kwargs["out"]]
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
    if not in_place or not args:
        return []
    if isinstance(args[0], Tensor):
        return [args[0]]
    if isinstance(args[0], (list, tuple)):
        return [t for t in args[0] if isinstance(t, Tensor)]
    return []


def _rows(whole: Tensor, like: DTensor) -> Tensor:
    with torch.no_grad():
        return distribute_tensor(whole.detach(), like.device_mesh, like.placements, src_data_rank=None).to_local()


def plain_tensors(output: Any) -> Any:
    """A step's output with every DTensor in it made whole (a loss that is a penalty alone), as under DDP."""
    if isinstance(output, DTensor):
        return output.full_tensor()
    if isinstance(output, dict):
        return {key: plain_tensors(value) for key, value in output.items()}
    if isinstance(output, (list, tuple)):
        return type(output)(plain_tensors(value) for value in output)
    return output


# What DTensor says when code reads a shard as if it were the whole parameter.
_DTENSOR_ERRORS = ("does not have a sharding strategy registered", "got mixed torch.Tensor and DTensor")


def explain(exception: BaseException) -> str | None:
    """A note for such an error outside ``training_step`` (``optimizer_step``, ``on_train_batch_end``, a callback),
    where the module's parameters are this rank's shards; ``None`` for any other error."""
    if not any(text in str(exception) for text in _DTENSOR_ERRORS):
        return None
    return (
        "Code read a sharded parameter (a DTensor holding this rank's rows) as if it were the whole parameter, with"
        " an op that needs all of it (a constraint such as `torch.renorm`, a plain tensor of another shape). In"
        " `training_step` such code computes on whole parameters as under DDP (a penalty on the weights, a"
        " constraint after a manual `opt.step()`); outside it, between steps, FSDP2's parameters are shards. Move"
        " the code into `training_step`, or, for gradients and parameters before the step, into"
        " `on_before_optimizer_step` (whole under `hook_view='whole'`), or compute on `p.full_tensor()` and write"
        " the result back with `p.copy_(distribute_tensor(result, p.device_mesh, p.placements))`."
    )
