"""The (replicate, shard) mesh shape and the device mesh built from it."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from fsdp_strategy.sharding.mesh import SHARD_DIM, build_device_mesh, resolve_mesh_shape


def mesh_error(replicate: int, shard: int, world: int) -> str:
    return (
        f"The device mesh does not fit the world: replicate_size={replicate} x shard_size={shard}"
        f" must equal the world size {world} (num_nodes x devices). Choose sizes whose product is"
        f" {world}, or leave one of them unset."
    )


@pytest.mark.parametrize(
    ("world", "replicate", "shard", "per_node", "expected"),
    [
        (1, None, None, None, (1, 1)),  # default: 1-D, everything sharded
        (8, None, None, None, (1, 8)),
        (8, None, None, 4, (2, 4)),  # hybrid: shard within a node of 4, replicate across 2 nodes
        (8, None, None, 8, (1, 8)),  # hybrid on one node degenerates to full sharding
        (8, 2, None, None, (2, 4)),  # missing shard size derived
        (8, None, 2, None, (4, 2)),  # missing replicate size derived
        (8, 2, 4, None, (2, 4)),
        (8, None, 2, 4, (4, 2)),  # an explicit shard size wins over processes_per_node
        (6, 6, None, None, (6, 1)),  # pure replication
    ],
)
def test_resolve_mesh_shape_table(world, replicate, shard, per_node, expected):
    shape = resolve_mesh_shape(world, replicate_size=replicate, shard_size=shard, processes_per_node=per_node)
    assert shape == expected
    assert shape[0] * shape[1] == world


def test_sizes_whose_product_is_not_the_world_size_are_rejected():
    with pytest.raises(ValueError, match=re.escape(mesh_error(2, 3, 8))):
        resolve_mesh_shape(8, replicate_size=2, shard_size=3)


def divisor_error(label: str, size: int, world: int) -> str:
    return (
        f"The device mesh does not fit the world: {label}={size} does not divide the world size"
        f" {world} (num_nodes x devices). Choose a divisor of {world}, or leave it unset."
    )


def test_replicate_size_that_does_not_divide_the_world_is_rejected():
    with pytest.raises(ValueError, match=re.escape(divisor_error("replicate_size", 3, 4))):
        resolve_mesh_shape(4, replicate_size=3, shard_size=None)


def test_shard_size_that_does_not_divide_the_world_is_rejected():
    with pytest.raises(ValueError, match=re.escape(divisor_error("shard_size", 3, 4))):
        resolve_mesh_shape(4, replicate_size=None, shard_size=3)


def test_hybrid_with_processes_per_node_not_dividing_the_world_is_rejected():
    label = "hybrid sharding's shard size (devices per node)"
    with pytest.raises(ValueError, match=re.escape(divisor_error(label, 4, 6))):
        resolve_mesh_shape(6, replicate_size=None, shard_size=None, processes_per_node=4)


@pytest.mark.parametrize("option", ["replicate_size", "shard_size", "processes_per_node"])
def test_non_positive_sizes_are_rejected(option):
    with pytest.raises(ValueError, match=re.escape(f"`{option}` must be a positive int; got 0.")):
        resolve_mesh_shape(4, **{"replicate_size": None, "shard_size": None, option: 0})


def test_build_device_mesh_on_one_rank_is_1d_with_the_shard_dim(single_rank_group):
    mesh = build_device_mesh("cpu", 1, 1)
    assert mesh.mesh_dim_names == (SHARD_DIM,) == ("dp_shard",)
    assert mesh.ndim == 1
    assert mesh.size() == 1
    assert mesh.device_type == "cpu"
    assert mesh.get_group(SHARD_DIM).size() == dist.get_world_size() == 1
