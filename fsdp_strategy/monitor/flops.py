"""FLOPs: counting one training batch's, the device's peak FLOP/s, and the model FLOPs utilization.

``torch.utils.flop_counter.FlopCounterMode`` counts the first real training batch (forward and
backward of one micro-batch): under FSDP2 the compute runs on gathered plain tensors, so the count
equals Lightning's ``measure_flops`` on an unsharded copy. Activation checkpointing recomputes
forwards, and the recomputation is counted too.
"""

from __future__ import annotations

import math

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["BatchFlops", "compute_dtype", "model_flops_utilization", "peak_flops_per_device"]


class BatchFlops:
    """The FLOPs of one batch: counted from :meth:`start` to :meth:`stop`, once; NaN until then."""

    def __init__(self) -> None:
        self.per_batch = math.nan
        self._counter: FlopCounterMode | None = None

    @property
    def counting(self) -> bool:
        return self._counter is not None

    def start(self) -> None:
        """Starts counting, unless a batch has been counted or is being counted."""
        if math.isnan(self.per_batch) and self._counter is None:
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def stop(self) -> None:
        """Stops counting and keeps the count, if counting."""
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.per_batch = float(counter.get_total_flops())


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matmuls run in under ``Trainer(precision=...)``: it selects the device's peak."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return torch.float32


def peak_flops_per_device(device: torch.device, precision: str, peak_tflops: float | None) -> float | None:
    """The user's ``peak_tflops``, else Lightning's datasheet table (CUDA and TPU only)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type not in ("cuda", "xla"):  # the only devices Lightning's table knows
        return None
    flops = get_available_flops(device, compute_dtype(precision))
    return None if flops is None else float(flops)


def model_flops_utilization(tflops_per_sec: float | None, peak_flops: float | None) -> float | None:
    """The share of the device's peak that the measured TFLOP/s reach; ``None`` where either is unknown."""
    return tflops_per_sec * 1e12 / peak_flops if tflops_per_sec is not None and peak_flops else None
