"""The peak bytes of live tensors during the first training steps, counted storage by storage.

RSS includes what the allocator keeps (on CPU, glibc's heap fragments after a few steps) and CUDA's
``max_memory_allocated`` counts the caching allocator's blocks; neither is what the estimator predicts.
:class:`LiveTensorPeak` counts the tensors themselves (:class:`~fsdp_strategy.estimator.live_tensors.LiveTensors`):
at the first batch it takes every tensor the process holds (model state, batches, FSDP2's freed
all-gather outputs, and anything else still referenced, such as a model of an earlier fit), then follows each op's outputs and each storage's release until ``steps`` optimizer
steps have ended. Counting costs Python work on every op, so it covers the first steps only, which the
throughput leaves out as warm-up when ``steps <= warmup_steps``.
"""

from __future__ import annotations

import gc
import math
from typing import Any

from fsdp_strategy.estimator.live_tensors import LiveTensors, existing_tensors

__all__ = ["LiveTensorPeak"]


class LiveTensorPeak:
    """Counts live tensor bytes from :meth:`start` (the first batch) until ``steps`` optimizer steps are done."""

    def __init__(self, steps: int, device: str = "cpu") -> None:
        self.steps = steps
        self.device = device  # the device type whose tensors count: the host's on CPU, the GPU's on CUDA
        self.peak_bytes = math.nan
        self._live: LiveTensors | None = None
        self._done = steps == 0

    @property
    def counting(self) -> bool:
        return self._live is not None

    def collect(self) -> None:
        """Frees unreachable cycles (an earlier fit's Trainer and model), which are not live; call it before the
        fit's starting RSS is read, so that the freed memory does not show as negative growth."""
        if not self._done:
            gc.collect()

    def start(self, step: int) -> None:
        """Starts counting at optimizer step ``step`` if it is one of the first ``steps``, unless counting."""
        if self._done or self._live is not None or step >= self.steps:
            return
        live = LiveTensors(device=self.device)
        live.__enter__()
        live.track(existing_tensors())
        self._live = live

    def stop(self, step: int | None = None) -> None:
        """Stops counting once ``step`` optimizer steps are done (``None``: now, e.g. on an exception)."""
        live = self._live
        if live is None or (step is not None and step < self.steps):
            return
        self._live, self._done = None, True
        live.__exit__(None, None, None)
        self.peak_bytes = float(live.peak)

    def state(self) -> dict[str, Any]:
        return {"live_peak_bytes": self.peak_bytes}
