"""How a parameter's rows are spread over the ranks, and sums over all of them.

FSDP2 shards every parameter on dim 0 as ``torch.chunk`` cuts it: ``ceil(rows / W)`` rows per rank, the last
ranks holding fewer or none. Under hybrid sharding the other mesh dimension replicates, so a sum over the rows
runs in the shard dimension's group only. The distributed optimizers accept exactly these layouts; a parameter
split otherwise (tensor parallelism) is refused by :func:`row_shards` before training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["RowShards", "UnsupportedLayout", "all_reduce_sums", "row_shards"]


class UnsupportedLayout(ValueError):
    """A parameter laid out other than by rows over one mesh dimension."""


@dataclass(frozen=True)
class RowShards:
    """Where one parameter's rows live: ``group`` (None: every row is here) of ``size`` ranks, this rank's ``rank``."""

    rows: int
    group: dist.ProcessGroup | None
    rank: int
    size: int

    def rows_of(self, rank: int) -> int:
        per_rank = -(-self.rows // self.size)
        return max(0, min(per_rank, self.rows - rank * per_rank))

    def start_of(self, rank: int) -> int:
        return min(self.rows, rank * -(-self.rows // self.size))

    def local(self, whole: Tensor) -> Tensor:
        """This rank's rows of a tensor of the parameter's global dim 0 (a state entry loaded whole)."""
        return whole.narrow(0, self.start_of(self.rank), self.rows_of(self.rank))

    def as_like(self, local: Tensor, param: Tensor) -> Tensor:
        """``local`` (this rank's rows) as a DTensor laid out as ``param``, or itself where ``param`` is plain."""
        if not isinstance(param, DTensor):
            return local
        shape = (self.rows, *local.shape[1:])
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=shape, stride=_contiguous(shape))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def row_shards(param: Tensor, *, optimizer: str) -> RowShards:
    """The layout of ``param``; raises :class:`UnsupportedLayout` naming ``optimizer`` for any other than rows."""
    if not isinstance(param, DTensor):
        return RowShards(rows=param.shape[0] if param.ndim else 1, group=None, rank=0, size=1)
    placements = param.placements
    sharded = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    if len(sharded) > 1 or (sharded and placements[sharded[0]] != Shard(0)):
        raise UnsupportedLayout(
            f"{optimizer} runs distributed on parameters sharded by rows over one mesh dimension (FSDP2's own"
            f" layout, also under hybrid sharding); this one is laid out as {tuple(placements)} on"
            f" {param.device_mesh}, as tensor parallelism splits it. Use `tensor_parallel_size=1` with {optimizer},"
            " or an elementwise optimizer (AdamW, SGD) for the split parameters."
        )
    if not sharded:
        return RowShards(rows=param.shape[0], group=None, rank=0, size=1)
    mesh, dim = param.device_mesh, sharded[0]
    shards = RowShards(
        rows=param.shape[0], group=mesh.get_group(dim), rank=mesh.get_local_rank(dim), size=mesh.size(dim)
    )
    if param.to_local().shape[0] != shards.rows_of(shards.rank):
        # FSDP2 changed how it cuts dim 0: every distributed step would read misplaced rows.
        raise UnsupportedLayout(
            f"{optimizer}: this rank holds {param.to_local().shape[0]} of {shards.rows} rows, where torch.chunk's cut"
            f" gives {shards.rows_of(shards.rank)}; this torch release shards differently than the distributed"
            " optimizers expect."
        )
    return shards


def all_reduce_sums(values: list[Tensor], group: dist.ProcessGroup | None) -> list[Tensor]:
    """Each tensor summed over ``group`` in one all-reduce of them all, flattened together (float64, so that the
    order of the ranks' partial sums costs no precision a one-process sum has)."""
    if group is None or not values:
        return values
    flat = torch.cat([v.reshape(-1).to(torch.float64) for v in values])
    dist.all_reduce(flat, group=group)
    out, start = [], 0
    for v in values:
        out.append(flat[start : start + v.numel()].view(v.shape).to(v.dtype))
        start += v.numel()
    return out
