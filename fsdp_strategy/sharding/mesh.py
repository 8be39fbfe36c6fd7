"""The device mesh: 1-D for full sharding, 2-D (replicate, shard) for hybrid sharding, and with tensor parallelism
a last ``tensor_parallel`` dimension.

With tensor parallelism the dimensions carry the names of Lightning's ``ModelParallelStrategy`` (``data_parallel``,
``tensor_parallel``), so a ``configure_model`` written for it indexes this mesh unchanged; under hybrid sharding the
mesh is ``(dp_replicate, dp_shard, tensor_parallel)`` and ``data_parallel`` names the two first ones flattened.
``init_device_mesh`` lays ranks out row-major, so a tensor-parallel group is ``tensor_parallel_size`` consecutive
ranks (within a node) and the data-parallel rank is the global rank divided by that size.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_strategy._compat import flatten_mesh
from fsdp_strategy.option_checks import check_positive_int

__all__ = [
    "DATA_PARALLEL_DIM",
    "REPLICATE_DIM",
    "SHARD_DIM",
    "TENSOR_PARALLEL_DIM",
    "build_device_mesh",
    "data_parallel_mesh",
    "data_parallel_world",
    "resolve_mesh_shape",
    "resolve_tensor_parallel_size",
    "tensor_parallel_mesh",
]

# torch's own HSDP convention: the replicate dimension comes first.
REPLICATE_DIM = "dp_replicate"
SHARD_DIM = "dp_shard"
# Lightning's ModelParallelStrategy's names, which the modules written for it index.
DATA_PARALLEL_DIM = "data_parallel"
TENSOR_PARALLEL_DIM = "tensor_parallel"


def resolve_tensor_parallel_size(size: int | str, processes_per_node: int) -> int:
    """``tensor_parallel_size`` in ranks: ``"auto"`` is every device of a node, as ``ModelParallelStrategy``'s
    default, which leaves the nodes to data parallelism."""
    return processes_per_node if size == "auto" else int(size)


def data_parallel_world(world_size: int, tensor_parallel_size: int, processes_per_node: int | None = None) -> int:
    """The number of data-parallel ranks: ``world_size`` over ``tensor_parallel_size``, which must divide the
    processes of a node (a tensor-parallel group communicates on every layer: it stays within a node)."""
    check_positive_int("tensor_parallel_size", tensor_parallel_size)
    within = processes_per_node or world_size
    if within % tensor_parallel_size or world_size % tensor_parallel_size:
        raise ValueError(
            f"The device mesh does not fit the world: tensor_parallel_size={tensor_parallel_size} must divide the"
            f" devices per node ({within}) and the world size ({world_size}). Choose a divisor of {within}."
        )
    return world_size // tensor_parallel_size


def data_parallel_sampler(world_size: int, global_rank: int, tensor_parallel_size: int) -> dict[str, int]:
    """``DistributedSampler``'s ``num_replicas`` and ``rank`` for ``global_rank``: a tensor-parallel group's
    consecutive ranks share one data-parallel rank, and its batches."""
    return {"num_replicas": world_size // tensor_parallel_size, "rank": global_rank // tensor_parallel_size}


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


def build_device_mesh(
    device_type: str, replicate_size: int, shard_size: int, tensor_parallel_size: int | None = None
) -> DeviceMesh:
    """A 1-D ``(dp_shard,)`` mesh, or a 2-D ``(dp_replicate, dp_shard)`` mesh when replicating; with a
    ``tensor_parallel_size`` (1 included) ``(data_parallel, tensor_parallel)``, or
    ``(dp_replicate, dp_shard, tensor_parallel)``."""
    if tensor_parallel_size is None:
        if replicate_size == 1:
            return init_device_mesh(device_type, (shard_size,), mesh_dim_names=(SHARD_DIM,))
        return init_device_mesh(device_type, (replicate_size, shard_size), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
    if replicate_size == 1:
        shape, names = (shard_size, tensor_parallel_size), (DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    shape, names = (replicate_size, shard_size, tensor_parallel_size), (REPLICATE_DIM, SHARD_DIM, TENSOR_PARALLEL_DIM)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    flatten_mesh(mesh[(REPLICATE_DIM, SHARD_DIM)], DATA_PARALLEL_DIM)
    return mesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dimensions ``fully_shard`` shards and replicates over: the whole mesh without tensor parallelism."""
    names = mesh.mesh_dim_names or ()
    if TENSOR_PARALLEL_DIM not in names:
        return mesh
    return mesh[(REPLICATE_DIM, SHARD_DIM)] if REPLICATE_DIM in names else mesh[DATA_PARALLEL_DIM]


def tensor_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The ``tensor_parallel`` dimension, or ``None`` on a mesh without one."""
    return mesh[TENSOR_PARALLEL_DIM] if TENSOR_PARALLEL_DIM in (mesh.mesh_dim_names or ()) else None
