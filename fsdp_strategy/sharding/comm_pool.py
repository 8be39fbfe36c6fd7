"""Reusing the flat buffers of FSDP2's collectives on CPU, instead of a fresh ``malloc`` for each one.

Each block unit all-gathers into a flat buffer of its full size twice per micro-batch and reduce-scatters its
gradients from another once. On CUDA the caching allocator hands the same memory back each time. On CPU every
buffer is a new ``malloc`` block: glibc serves blocks of this size from fresh mappings or from the top of the heap,
hands them back to the system when they are freed, and the next buffer then faults its pages in and zeroes them
again (on the 116M benchmark GPT 12-16% of the CPU time of a step, docs/benchmarks.md).

:func:`reuse_buffers` gives each unit an all-gather and a reduce-scatter (FSDP2's public
``set_custom_all_gather``/``set_custom_reduce_scatter``) that run the same collectives as FSDP2's defaults but take
their buffers from a :class:`BufferPool`. Only buffers that FSDP2 uses internally are reused: the all-gather
output (copied out into the parameters) and the reduce-scatter input (the unsharded gradients, copied in). The
reduce-scatter output becomes the sharded gradient that user code and optimizers hold, and stays a fresh tensor.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from fsdp_strategy._compat import all_gather_single, reduce_scatter_single

__all__ = ["BufferPool", "reuse_buffers"]


class _Buffer:
    __slots__ = ("memory", "lent")

    def __init__(self, memory: Tensor) -> None:
        self.memory = memory
        self.lent: weakref.ref[Tensor] | None = None  # the tensor handed out last, while it is alive


class BufferPool:
    """Flat buffers on the host, by size and dtype, each lent out again once the tensor lent before is gone.

    A lent tensor is a tensor of its own over the buffer's storage; FSDP2 and gloo keep it (or views of it,
    which hold it) for as long as they use the memory, so a buffer is in use exactly while that tensor lives,
    and the pool has as many buffers of a size as were ever in use at once.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device], list[_Buffer]] = {}

    def take(self, size: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        if torch.device(device).type != "cpu":
            # CUDA's caching allocator reuses memory already, and knows which stream uses it: a pooled buffer
            # would bypass that (a unit offloaded to the host still gathers on the GPU).
            return torch.empty(*size, dtype=dtype, device=device)
        numel = math.prod(size)
        buffers = self._buffers.setdefault((numel, dtype, torch.device(device)), [])
        buffer = next((b for b in buffers if b.lent is None or b.lent() is None), None)
        if buffer is None:
            buffer = _Buffer(torch.empty(numel, dtype=dtype, device=device))
            buffers.append(buffer)
        lent = torch.empty(0, dtype=dtype, device=device).set_(buffer.memory.untyped_storage(), 0, tuple(size))
        buffer.lent = weakref.ref(lent)
        return lent

    @property
    def nbytes(self) -> int:
        return sum(b.memory.untyped_storage().nbytes() for buffers in self._buffers.values() for b in buffers)


class _UnitCollectives:
    """What one unit's all-gather and reduce-scatter share: the pool, and the size of the unit's full buffer."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.full_numel: int | None = None  # the all-gather output's, which the reduce-scatter input equals


class _PooledAllGather:
    def __init__(self, unit: _UnitCollectives) -> None:
        self.unit = unit

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        self.unit.full_numel = math.prod(size)
        return self.unit.pool.take(size, dtype, device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _PooledReduceScatter:
    def __init__(self, unit: _UnitCollectives) -> None:
        self.unit = unit

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        # The input is the unit's full size (world size x shard); the output, a shard, becomes the gradient.
        if math.prod(size) == self.unit.full_numel:
            return self.unit.pool.take(size, dtype, device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: object, async_op: bool = False
    ) -> dist.Work | None:
        return reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op)


def reuse_buffers(units: Iterable[nn.Module], *, shards: int) -> BufferPool | None:
    """Lets ``units`` (``fully_shard``-ed modules, each one unit) reuse their collectives' buffers on CPU.

    ``shards`` is the size of the mesh dimension they shard over: with one shard there is no collective (and the
    reduce-scatter's input and output would have the same size). Returns the pool, or ``None`` when nothing applies.
    """
    units = [u for u in units if isinstance(u, FSDPModule)]
    if shards < 2 or not units:
        return None
    pool = BufferPool()
    for unit in units:
        shared = _UnitCollectives(pool)
        unit.set_custom_all_gather(_PooledAllGather(shared))  # type: ignore[arg-type]
        unit.set_custom_reduce_scatter(_PooledReduceScatter(shared))  # type: ignore[arg-type]
    return pool
