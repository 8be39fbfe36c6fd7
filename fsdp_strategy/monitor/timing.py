"""Timing training without synchronizing: a clock that marks step boundaries (CUDA events on the
device), one rank's counters at such a boundary, and what was trained between two of them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Clock", "Point", "between"]


class Clock:
    """Wall time on the host; on CUDA, events on the current stream, so that marking a point in time
    never waits for the device, and only reading an interval does."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self._cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


@dataclass(frozen=True)
class Point:
    """Counters of one rank at a step boundary."""

    mark: Any
    samples: int
    tokens: int
    batches: int
    validation_seconds: float


def between(clock: Clock | None, start: Point | None, end: Point | None, *, tokens_known: bool) -> dict[str, float]:
    """Samples, tokens, batches and seconds of training from ``start`` to ``end``, validation left out;
    NaN for each when no batch lies between them."""
    if start is None or end is None or end.batches <= start.batches:
        return dict.fromkeys(("samples", "tokens", "batches", "seconds"), math.nan)
    assert clock is not None  # points are only marked on a clock
    validation = end.validation_seconds - start.validation_seconds
    return {
        "samples": end.samples - start.samples,
        "tokens": end.tokens - start.tokens if tokens_known else math.nan,
        "batches": end.batches - start.batches,
        "seconds": clock.seconds(start.mark, end.mark) - validation,
    }
