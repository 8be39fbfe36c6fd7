"""The data-parallel device mesh: 1-D for full sharding, 2-D (replicate, shard) for hybrid sharding."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_strategy.option_checks import check_positive_int

__all__ = ["REPLICATE_DIM", "SHARD_DIM", "build_device_mesh", "resolve_mesh_shape"]

# torch's own HSDP convention: the replicate dimension comes first.
REPLICATE_DIM = "dp_replicate"
SHARD_DIM = "dp_shard"


def resolve_mesh_shape(
    world_size: int, *, replicate_size: int | None, shard_size: int | None, processes_per_node: int | None = None
) -> tuple[int, int]:
    """Returns ``(replicate_size, shard_size)`` whose product is ``world_size``.

    A missing size is derived from the other one. With both missing the mesh is 1-D (everything
    sharded), unless ``processes_per_node`` is given: then hybrid sharding shards within a node
    and replicates across nodes.
    """
    for option, size in (
        ("replicate_size", replicate_size),
        ("shard_size", shard_size),
        ("processes_per_node", processes_per_node),
    ):
        if size is not None:
            check_positive_int(option, size)
    shard_label = "shard_size"
    if replicate_size is None and shard_size is None:
        if processes_per_node is None:
            return 1, world_size
        shard_size, shard_label = processes_per_node, "hybrid sharding's shard size (devices per node)"
    given = [(label, size) for label, size in (("replicate_size", replicate_size), (shard_label, shard_size)) if size]
    for label, size in given if len(given) == 1 else ():
        if world_size % size:
            raise ValueError(
                f"The device mesh does not fit the world: {label}={size} does not divide the world size"
                f" {world_size} (num_nodes x devices). Choose a divisor of {world_size}, or leave it unset."
            )
    replicate_size = replicate_size or world_size // shard_size
    shard_size = shard_size or world_size // replicate_size
    if replicate_size * shard_size != world_size:
        raise ValueError(
            f"The device mesh does not fit the world: replicate_size={replicate_size} x shard_size={shard_size}"
            f" must equal the world size {world_size} (num_nodes x devices). Choose sizes whose product is"
            f" {world_size}, or leave one of them unset."
        )
    return replicate_size, shard_size


def build_device_mesh(device_type: str, replicate_size: int, shard_size: int) -> DeviceMesh:
    """A 1-D ``(dp_shard,)`` mesh, or a 2-D ``(dp_replicate, dp_shard)`` mesh when replicating."""
    if replicate_size == 1:
        return init_device_mesh(device_type, (shard_size,), mesh_dim_names=(SHARD_DIM,))
    return init_device_mesh(device_type, (replicate_size, shard_size), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
