"""The pool of collective buffers: memory is lent again only once nothing uses it."""

from __future__ import annotations

import gc

import torch
from torch.distributed.fsdp import fully_shard

from fsdp_strategy.sharding.comm_pool import BufferPool, reuse_buffers
from testkit.models import TinyLM


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_a_buffer_is_lent_again_once_the_tensor_lent_before_is_gone():
    pool = BufferPool()
    first = pool.take((4, 8), torch.float32, torch.device("cpu"))
    assert first.shape == (4, 8) and first.dtype == torch.float32
    address = _address(first)
    del first
    again = pool.take((32,), torch.float32, torch.device("cpu"))  # another shape of the same size
    assert _address(again) == address and again.shape == (32,)
    assert pool.nbytes == 32 * 4


def test_views_and_copies_in_flight_keep_a_buffer_from_being_lent():
    pool = BufferPool()
    lent = pool.take((16,), torch.float32, torch.device("cpu"))
    lent.copy_(torch.arange(16.0))
    parts = torch.split(lent, [6, 10])  # what FSDP2's copy-out keeps
    address = _address(lent)
    del lent
    gc.collect()
    second = pool.take((16,), torch.float32, torch.device("cpu"))
    assert _address(second) != address  # the views still read the first buffer
    second.fill_(-1.0)
    assert torch.equal(torch.cat(parts), torch.arange(16.0))
    del parts
    assert _address(pool.take((16,), torch.float32, torch.device("cpu"))) == address
    assert pool.nbytes == 2 * 16 * 4


def test_sizes_and_dtypes_have_buffers_of_their_own():
    pool = BufferPool()
    kept = [
        pool.take((8,), torch.float32, torch.device("cpu")),
        pool.take((8,), torch.bfloat16, torch.device("cpu")),
        pool.take((9,), torch.float32, torch.device("cpu")),
    ]
    assert len({_address(t) for t in kept}) == 3
    assert pool.nbytes == 8 * 4 + 8 * 2 + 9 * 4


def test_one_shard_has_no_collectives_to_pool(mesh):
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert reuse_buffers(list(model.blocks), shards=1) is None


def test_only_sharded_units_and_host_buffers_are_pooled():
    assert reuse_buffers([TinyLM().blocks[0]], shards=2) is None  # not a sharded unit
    pool = BufferPool()
    off_the_host = pool.take((8,), torch.float32, torch.device("meta"))  # as a GPU's buffer: left to its allocator
    assert off_the_host.device.type == "meta" and pool.nbytes == 0
