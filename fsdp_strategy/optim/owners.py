"""Whole matrices computed once each, on an owner rank, from the shards every rank holds (dion's pattern).

A function of a whole matrix (Muon's Newton-Schulz orthogonalization) cannot run on row shards. Gathering each
matrix on every rank would repeat the work W times and all-gather every matrix; here the matrices of one shard
group are dealt out in batches of at most W, one per rank: one ``all_to_all`` brings each owner the rows of its
matrix from every rank, the owner computes, and a second ``all_to_all`` sends each rank its rows of the results.
Per step and rank that sends ``2 (W - 1) / W^2`` of the matrices' bytes, and a rank holds at most one whole
matrix (and its result) at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fsdp_strategy.optim.rows import RowShards

__all__ = ["apply_whole"]


def apply_whole(
    locals_: Sequence[Tensor], layouts: Sequence[RowShards], fn: Callable[[Tensor], Tensor]
) -> list[Tensor]:
    """``fn`` of each whole matrix, as this rank's rows: ``locals_[i]`` is this rank's rows of matrix ``i``, laid out
    by ``layouts[i]``; every rank calls it with the same matrices in the same order."""
    results: list[Tensor | None] = [None] * len(locals_)
    by_group: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
    for i, (local, layout) in enumerate(zip(locals_, layouts)):
        if layout.group is None:
            results[i] = fn(local)
        else:
            by_group.setdefault((id(layout.group), local.dtype, local.device), []).append(i)
    for indices in by_group.values():
        size = layouts[indices[0]].size
        # Largest first, so that each batch's owners wait about as long for one another.
        ordered = sorted(indices, key=lambda i: -layouts[i].rows * _columns(locals_[i]))
        for start in range(0, len(ordered), size):
            batch = ordered[start : start + size]
            for i, result in zip(batch, _batch([locals_[i] for i in batch], [layouts[i] for i in batch], fn)):
                results[i] = result
    return results  # type: ignore[return-value]


def _batch(locals_: list[Tensor], layouts: list[RowShards], fn: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """Matrix ``j`` of the batch is owned by rank ``j`` of the group."""
    group, rank, size = layouts[0].group, layouts[0].rank, layouts[0].size
    columns = [_columns(local) for local in locals_]
    # Rank `rank` sends its rows of matrix j to owner j, and receives the rows of its own matrix from every rank.
    send_sizes = [local.numel() for local in locals_] + [0] * (size - len(locals_))
    owned = rank < len(locals_)
    receive_sizes = [layouts[rank].rows_of(r) * columns[rank] if owned else 0 for r in range(size)]
    send = torch.cat([local.reshape(-1) for local in locals_])
    gathered = send.new_empty(sum(receive_sizes))
    dist.all_to_all_single(gathered, send, receive_sizes, send_sizes, group=group)
    result = None
    if owned:
        whole = gathered.view(layouts[rank].rows, *locals_[rank].shape[1:])
        result = fn(whole).to(send.dtype).reshape(-1)
        del whole, gathered
    # And back: the owner sends each rank its rows of the result, each rank receives its rows of every result.
    back = result if result is not None else send.new_empty(0)
    returned = send.new_empty(send.numel())
    dist.all_to_all_single(returned, back, send_sizes, receive_sizes, group=group)
    out, offset = [], 0
    for local in locals_:
        out.append(returned[offset : offset + local.numel()].view(local.shape))
        offset += local.numel()
    return out


def _columns(local: Tensor) -> int:
    width = 1
    for extent in local.shape[1:]:
        width *= extent
    return width
