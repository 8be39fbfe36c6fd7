"""``ShardingPlan``: how a model is sharded in the current world, as a cost model needs to know it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardingPlan"]


@dataclass(frozen=True)
class ShardingPlan:
    """How :class:`FSDP2Strategy` shards a model in the current world: what a cost model (the
    estimator, through ``ShardingMonitor``) needs to know besides the model and the Trainer."""

    mesh_shape: tuple[int, int]  # (replicate, shard) of the data-parallel ranks
    reshard_after_forward: bool | int
    cpu_offload: bool
    sync_grads_each_micro_batch: bool = False  # a reduce-scatter per micro-batch of gradient accumulation
    tensor_parallel_size: int = 1  # ranks that split each layer: the world is replicate x shard x this
