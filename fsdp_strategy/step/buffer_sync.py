"""Module state that DDP keeps equal on every rank: rank 0's parameters at the start, and its buffers.

DDP broadcasts rank 0's parameters and buffers when it wraps a module, so a module built with a
different random init on each rank (no ``seed_everything``) trains from rank 0's init. During ``fit``
it also broadcasts rank 0's buffers (BatchNorm's running statistics, any buffer a forward updates)
before a forward whenever the forward before it ran with gradient synchronization
(``broadcast_buffers=True``, ``DistributedDataParallel._pre_forward``): before the first forward, before
each training step that follows the last micro-batch of an optimizer step (not before the later
micro-batches of a gradient accumulation, which run in ``no_sync``), and before the first validation
step after training; under Lightning's manual optimization only before the first forward. FSDP2 shards
parameters, and ranks cannot disagree on a shard, but it leaves buffers alone; this module does what
DDP does for them.

Buffers are broadcast all at once, flattened per device and dtype: one collective per dtype, none for
a module without buffers. (Which buffers changed cannot be told cheaply: BatchNorm updates its running
statistics without bumping their version counters, and code that writes ``buffer.data`` never does.)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from fsdp_strategy.step.hooks import StepHook

__all__ = [
    "BufferSync",
    "BufferSyncHook",
    "broadcast_tensors",
    "check_sync_batchnorm",
    "module_buffers",
    "sync_module_states",
]

# DDP's default bucket for the same broadcast (``broadcast_bucket_size``): bounds the extra memory of
# flattening a module's parameters into one message.
BUCKET_BYTES = 250 * 1024 * 1024


def _ignored(module: nn.Module) -> set[str]:
    # The names DDP skips, set with DistributedDataParallel._set_params_and_buffers_to_ignore_for_model;
    # honoured so that a module prepared for DDP behaves the same here.
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def module_buffers(module: nn.Module) -> list[Tensor]:
    ignored = _ignored(module)
    return [b for name, b in module.named_buffers() if name not in ignored and not b.is_meta]


def sync_module_states(
    module: nn.Module,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    host_group: dist.ProcessGroup | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Copies rank ``src``'s unsharded parameters and its buffers to every rank, as DDP does at wrap time.

    Sharded (DTensor) parameters are left alone: each rank owns its shard. Meta tensors are skipped. Tensors
    in host memory go over ``host_group`` when given (a model built on the CPU, synced before sharding moves
    it to the GPU: NCCL cannot send host memory).
    """
    ignored = _ignored(module)
    params = [
        p.detach()
        for name, p in module.named_parameters()
        if name not in ignored and not isinstance(p, DTensor) and not p.is_meta
    ]
    broadcast_tensors(
        [*params, *module_buffers(module)], src=src, group=group, host_group=host_group, bucket_bytes=bucket_bytes
    )


def broadcast_tensors(
    tensors: Iterable[Tensor],
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    host_group: dist.ProcessGroup | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Overwrites ``tensors`` with rank ``src``'s values, one collective per bucket of one device and dtype
    (over ``host_group``, when given, for tensors in host memory)."""
    open_buckets: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], int]] = {}
    buckets: list[list[Tensor]] = []
    for tensor in tensors:
        bucket, size = open_buckets.get((tensor.device, tensor.dtype), ([], 0))
        if not bucket or size + tensor.nbytes > bucket_bytes:
            bucket, size = [], 0
            buckets.append(bucket)
        bucket.append(tensor)
        open_buckets[(tensor.device, tensor.dtype)] = (bucket, size + tensor.nbytes)
    with torch.no_grad():
        for bucket in buckets:
            on = host_group if host_group is not None and bucket[0].device.type == "cpu" else group
            if len(bucket) == 1 and bucket[0].is_contiguous():
                dist.broadcast(bucket[0], src=src, group=on)
                continue
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, src=src, group=on)
            for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                tensor.copy_(part.view_as(tensor))


class BufferSync:
    """DDP's ``broadcast_buffers=True`` during ``fit``: rank 0's buffers before the forwards DDP syncs them for.

    Call :meth:`before_step` before each training or validation step and :meth:`after_step` after it,
    on every rank. A module without buffers costs nothing.
    """

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
        self.module = module
        self.group = group
        self._pending = True  # DDP syncs before its first forward

    def before_step(self) -> None:
        if self._pending:
            broadcast_tensors(module_buffers(self.module), group=self.group)  # re-read: buffers may be reassigned

    def after_step(self, *, gradient_sync: bool) -> None:
        """``gradient_sync``: the step's forward ran with gradients enabled and outside ``no_sync``."""
        self._pending = gradient_sync


def check_sync_batchnorm(module: nn.Module, device: torch.device) -> None:
    """The error DDP raises when wrapping a module with ``SyncBatchNorm`` layers on the CPU."""
    if device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise ValueError("SyncBatchNorm layers only work with GPU modules")


class BufferSyncHook(StepHook):
    """:class:`BufferSync` around each training and validation forward of ``fit``."""

    def __init__(self, module: nn.Module) -> None:
        self.sync = BufferSync(module)

    def before_forward(self) -> None:
        self.sync.before_step()

    def after_forward(self, *, training: bool, gradient_sync: bool) -> None:
        self.sync.after_step(gradient_sync=gradient_sync)
