"""The collectives of a non-final micro-batch of gradient accumulation.

By default a non-final micro-batch runs none (FSDP2's ``no_sync``): each unit keeps its gradients unsharded, at
full size, until the window's last micro-batch reduces them once. With ``sharded=True`` every micro-batch
reduce-scatters, so only gradient shards are kept between micro-batches. Under hybrid sharding the cross-replica
all-reduce is linear, so it is needed once per window: FSDP2 adds each non-final micro-batch's reduce-scattered
shard to a partial sum it keeps per unit (``set_requires_all_reduce(False)``), and the last micro-batch
all-reduces that sum once. Until then ``param.grad`` is not written: the partial sum lives inside FSDP2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["accumulation_micro_batch", "writes_gradients"]


@contextlib.contextmanager
def accumulation_micro_batch(
    model: nn.Module | None, *, sharded: bool, replicated: bool
) -> Generator[None, None, None]:
    """A non-final micro-batch of ``model`` (a ``fully_shard``-ed root; anything else is left alone).

    ``sharded``: reduce-scatter inside (``sync_grads_each_micro_batch``); else accumulate unsharded gradients.
    ``replicated``: the mesh has a replicate dimension (hybrid sharding), whose all-reduce is then deferred.
    """
    if not isinstance(model, FSDPModule) or (sharded and not replicated):
        yield
        return
    if sharded:
        model.set_requires_all_reduce(False)
    else:
        model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        # Both flags back on: set_requires_gradient_sync(True) sets the all-reduce one too.
        model.set_requires_gradient_sync(True)


def writes_gradients(*, final: bool, sharded: bool, replicated: bool) -> bool:
    """Whether a backward leaves its reduced gradients in ``param.grad``: on the window's last micro-batch, and on
    every one when each reduce-scatter completes the reduction (``sharded`` without replicas to all-reduce over)."""
    return final or (sharded and not replicated)
