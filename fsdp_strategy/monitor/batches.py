"""What a training batch holds: its samples and tokens, read from its tensors or counted by the user's
functions, and their running totals on one rank."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["BatchCounter", "batch_size_of", "tokens_of"]


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch, depth first through mappings, lists and tuples."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def batch_size_of(batch: Any) -> tuple[int | None, bool]:
    """The first dimension of the batch's first tensor, and whether other tensors disagree with it."""
    sizes = [t.shape[0] for t in _tensors(batch) if t.dim() > 0]
    if not sizes:
        return None, False
    return int(sizes[0]), any(size != sizes[0] for size in sizes)


def tokens_of(batch: Any) -> tuple[int | None, bool]:
    """The element count of the batch's first integer tensor of two or more dimensions (token ids),
    and whether other such tensors disagree with it (then the count is ``None``)."""
    integer = [t for t in _tensors(batch) if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)]
    counts = [t.numel() for t in integer if t.dim() >= 2]
    if not counts:
        return None, False
    if any(count != counts[0] for count in counts):
        return None, True
    return counts[0], False


def _call_counter(option: str, fn: Callable[[Any], int], batch: Any) -> int:
    value = fn(batch)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{option}` must return an int; it returned {value!r} of type {type(value).__name__}.")
    return value


class BatchCounter:
    """Samples, tokens and batches that one rank has trained on, each batch counted as
    ``ShardingMonitor``'s options say (see there); ``tokens_known`` turns false for good once a batch's
    tokens cannot be told."""

    def __init__(
        self,
        *,
        batch_size_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], int] | None = None,
        tokens_per_sample: int | None = None,
    ) -> None:
        self.batch_size_fn = batch_size_fn
        self.tokens_fn = tokens_fn
        self.tokens_per_sample = tokens_per_sample
        self.samples = self.tokens = self.batches = 0
        self.tokens_known = True
        self._warned: set[str] = set()

    def count(self, batch: Any) -> None:
        if self.batch_size_fn is not None:
            samples = _call_counter("batch_size_fn", self.batch_size_fn, batch)
        else:
            samples, ambiguous = batch_size_of(batch)
            if ambiguous:
                self._warn_once(
                    "batch_size",
                    f"ShardingMonitor: the batch holds tensors of different lengths; counting {samples} samples"
                    " per batch. Pass `batch_size_fn` to say how many.",
                )
            samples = samples or 0
        self.samples += samples
        self.batches += 1
        if self.tokens_fn is not None:
            self.tokens += _call_counter("tokens_fn", self.tokens_fn, batch)
        elif self.tokens_per_sample is not None:
            self.tokens += samples * self.tokens_per_sample
        else:
            tokens, ambiguous = tokens_of(batch)
            if ambiguous:
                self._warn_once(
                    "tokens",
                    "ShardingMonitor: the batch holds integer tensors of different sizes, so tokens/s is not"
                    " reported. Pass `tokens_fn` or `tokens_per_sample`.",
                )
            if tokens is None:
                self.tokens_known = False
            else:
                self.tokens += tokens

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)
