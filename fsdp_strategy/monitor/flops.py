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

__all__ = ["BatchFlops", "compute_dtype", "datasheet_flops", "model_flops_utilization", "peak_flops_per_device"]


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


# Dense (no sparsity) peak TFLOP/s from the vendors' datasheets, for the datacenter GPUs whose names Lightning's
# table does not match (it knows "H200 SXM1"/"H200 NVL1", while torch reports an H200 as "NVIDIA H200") or lacks.
# "tf32": fp32 matmuls when torch.get_float32_matmul_precision() is not "highest", as Lightning counts them.
_DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "b200": {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0},  # HGX B200 datasheet, per GPU
    "h200 nvl": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0},
    "h200": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},  # H200 SXM
    "h100 nvl": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0},
    "h100 pcie": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "h100": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},  # H100 SXM
    "a100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "l40s": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
    "mi300x": {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4},
}
_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def datasheet_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The dense peak FLOP/s of the GPU named ``device_name`` (as ``torch.cuda.get_device_name`` reports it) for
    matmuls in ``dtype``; ``None`` for a GPU or dtype not in :data:`_DATASHEET_TFLOPS`."""
    name = device_name.lower()
    # The table lists a variant ("h200 nvl") before its chip ("h200"): the first row all of whose words match.
    chip = next((c for c in _DATASHEET_TFLOPS if all(part in name for part in c.split())), None)
    key = _DTYPE_KEYS.get(dtype)
    if chip is None or key is None:
        return None
    if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"
    return _DATASHEET_TFLOPS[chip][key] * 1e12


def peak_flops_per_device(device: torch.device, precision: str, peak_tflops: float | None) -> float | None:
    """The user's ``peak_tflops``, else the datasheet table above, else Lightning's (CUDA and TPU only)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type not in ("cuda", "xla"):  # the only devices the tables know
        return None
    dtype = compute_dtype(precision)
    if device.type == "cuda":
        known = datasheet_flops(torch.cuda.get_device_name(device), dtype)
        if known is not None:
            return known
    flops = get_available_flops(device, dtype)
    return None if flops is None else float(flops)


def model_flops_utilization(tflops_per_sec: float | None, peak_flops: float | None) -> float | None:
    """The share of the device's peak that the measured TFLOP/s reach; ``None`` where either is unknown."""
    return tflops_per_sec * 1e12 / peak_flops if tflops_per_sec is not None and peak_flops else None
