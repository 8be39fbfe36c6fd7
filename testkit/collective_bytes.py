"""Bytes the c10d collectives move, as the dispatcher sees them: a measurement to hold the estimator's figures to.

:class:`CollectiveBytes` is a ``TorchDispatchMode`` (what torch's ``CommDebugMode`` builds on, without its module
tracker, which fails on Lightning's step methods routed through FSDP). It adds up, per kind, the full-size tensor
bytes of each collective, as the estimator defines its figures: an all-gather counts its gathered output, a
reduce-scatter its unsharded input, an all-reduce its tensor. It sees FSDP2's ``c10d`` ops (``_allgather_base_``,
``_reduce_scatter_base_``, ``allreduce_``) and the functional collectives DTensor issues for tensor parallelism
(``_c10d_functional``), and keeps them apart: ``source`` ``"c10d"`` or ``"functional"``. It works on gloo.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveBytes"]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _c10d_ops() -> dict[Any, tuple[str, Any]]:
    # op -> (kind, how to read its full-size bytes from the op's arguments)
    c10d = torch.ops.c10d
    return {
        c10d._allgather_base_: ("all_gather", lambda args: _nbytes(args[0])),  # (output, input, group, ...)
        c10d._reduce_scatter_base_: ("reduce_scatter", lambda args: _nbytes(args[1])),  # (output, input, ...)
        c10d.allreduce_: ("all_reduce", lambda args: sum(_nbytes(t) for t in args[0])),  # (tensors, group, ...)
        c10d.allgather_: ("all_gather", lambda args: sum(_nbytes(t) for out in args[0] for t in out)),
        c10d.reduce_scatter_: ("reduce_scatter", lambda args: sum(_nbytes(t) for inp in args[1] for t in inp)),
    }


def _functional_ops() -> dict[Any, tuple[str, Any]]:
    functional = torch.ops._c10d_functional
    return {
        functional.all_reduce: ("all_reduce", lambda args: _nbytes(args[0])),  # (input, op, group_name)
        functional.all_gather_into_tensor: ("all_gather", lambda args: _nbytes(args[0]) * args[1]),  # group_size
        functional.reduce_scatter_tensor: ("reduce_scatter", lambda args: _nbytes(args[0])),
    }


class CollectiveBytes(TorchDispatchMode):
    """``with CollectiveBytes() as counted:`` ... ``counted.bytes[("functional", "all_reduce")]``; ``calls`` counts
    the collectives the same way. Only the ops above count; any other collective is in ``unknown`` by name."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.calls: Counter[tuple[str, str]] = Counter()
        self.unknown: Counter[str] = Counter()
        self._ops = {
            **{op: ("c10d", *how) for op, how in _c10d_ops().items()},
            **{op: ("functional", *how) for op, how in _functional_ops().items()},
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        packet = getattr(func, "_overloadpacket", None)
        found = self._ops.get(packet)
        if found is not None:
            source, kind, size = found
            self.bytes[(source, kind)] += size(args)
            self.calls[(source, kind)] += 1
        elif getattr(func, "namespace", None) in ("c10d", "_c10d_functional") and "wait_tensor" not in func.name():
            self.unknown[func.name()] += 1
        return func(*args, **(kwargs or {}))

    def totals(self) -> dict[str, int]:
        """``"source/kind"`` -> bytes, for a JSON record."""
        return {f"{source}/{kind}": count for (source, kind), count in sorted(self.bytes.items())}
