"""``ShardingMonitor``: what a strategy costs while it trains, in memory, speed and communication.

A Lightning callback that works with any strategy (``"fsdp2"`` and its variants, ``"ddp"``, one
device), so the same run can be compared across them. Per rank it records the peak memory (CUDA:
allocated and reserved; always: the peak resident set size of the process and its growth since fit
set up, before ``configure_model`` and sharding) and the bytes of model state held (local shards of
parameters, gradients and optimizer state). For the run it measures samples/s, tokens/s, TFLOP/s
and, where the device's peak is known, MFU, and it reads the bytes all-gathered, reduce-scattered
and all-reduced per optimizer step from the sharding plan
(:func:`fsdp_strategy.estimate.estimate_module`). Values are logged to the Trainer's loggers every
``log_every_n_steps`` and summarized in one table when fit ends.

Peaks are those of the fit: CUDA's peak statistics and, on Linux, the process's peak RSS (VmHWM)
are reset when fit sets up, so a second fit in the same process is measured on its own.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` around the first real training
batch (forward and backward of one micro-batch): under FSDP2 the compute runs on gathered plain
tensors, so the count equals Lightning's ``measure_flops`` on an unsharded copy. Activation
checkpointing recomputes forwards, and the recomputation is counted too.

No step synchronizes the ranks or the device: batches are timed at their boundaries (CUDA events
on the device), and the ranks exchange their numbers only at logging steps and once at the end.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode

from fsdp_strategy.checks import check_positive_int as _check_positive_int
from fsdp_strategy.estimate import Estimate, estimate_module, unique_parameters
from fsdp_strategy.sizes import format_bytes
from fsdp_strategy.strategy import FSDP2Strategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "ShardingMonitor",
    "batch_size_of",
    "format_summary",
    "model_state_bytes",
    "peak_memory",
    "summarize",
    "tokens_of",
]

MiB = 2**20

# One row per rank, gathered as a float64 tensor; NaN marks a value this rank could not measure.
_FIELDS = (
    "peak_rss_bytes",
    "rss_growth_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "model_state_bytes",
    "samples",
    "tokens",
    "batches",
    "seconds",
    "flops_per_batch",
)


# --- measuring one rank ---------------------------------------------------------------------------


def current_rss_bytes() -> int | None:
    """The resident set size of this process now, or ``None`` where neither psutil nor /proc has it."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.Process().memory_info().rss)
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def reset_peak_rss() -> bool:
    """Starts the process's peak resident set size afresh, as CUDA's peak is reset when fit starts
    (Linux only; elsewhere the peak stays the process's lifetime peak). Returns whether it did."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # 5: reset the peak RSS (VmHWM)
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The largest resident set size of this process since it started, or since :func:`reset_peak_rss`."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def peak_memory(device: torch.device, rss_at_start: int | None = None) -> dict[str, float]:
    """Peak host memory (and peak CUDA memory on a CUDA device) in bytes; NaN where not measurable."""
    peak_rss = peak_rss_bytes()
    memory = {
        "peak_rss_bytes": float(peak_rss),
        "rss_growth_bytes": math.nan if rss_at_start is None else float(peak_rss - rss_at_start),
        "peak_allocated_bytes": math.nan,
        "peak_reserved_bytes": math.nan,
    }
    if device.type == "cuda":
        memory["peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated(device))
        memory["peak_reserved_bytes"] = float(torch.cuda.max_memory_reserved(device))
    return memory


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def model_state_bytes(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes this rank holds of parameters, their gradients and optimizer state (local shards only).

    Tied parameters count once."""
    params = unique_parameters(module)
    total = sum(_local_bytes(p) for p in params)
    total += sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(_local_bytes(v) for v in state.values() if torch.is_tensor(v))
    return total


# --- reading a batch ------------------------------------------------------------------------------


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


# --- device peak and the sharding plan ------------------------------------------------------------


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


def plan_of(strategy: Any) -> dict[str, Any] | None:
    """The estimator's description of a Trainer strategy, or ``None`` when it has none.

    Any replicated mesh is estimated as ``fsdp2_hybrid``, which reshards after forward: with
    ``reshard_after_forward=False`` the figures are an approximation (the blocks are gathered once
    per micro-batch, not twice, and stay gathered until backward)."""
    if isinstance(strategy, FSDP2Strategy):
        replicate, shard = strategy.mesh_shape()
        if isinstance(strategy._offload_policy, CPUOffloadPolicy):
            name = "fsdp2_offload"
        elif replicate > 1:
            name = "fsdp2_hybrid"
        elif strategy._reshard_after_forward is False:
            name = "fsdp2_grad_op"
        elif strategy._reshard_after_forward is True:
            name = "fsdp2"
        else:  # resharding to a smaller group in forward is a plan the estimator does not model
            return None
        return {"strategy": name, "processes_per_node": shard if replicate > 1 else None}
    if isinstance(strategy, DDPStrategy):
        return {"strategy": "ddp", "processes_per_node": None}
    return None


def optimizer_name(optimizers: list[torch.optim.Optimizer]) -> str | None:
    """The estimator's name for the optimizer(s), or ``None`` for a kind it does not know."""
    names = set()
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the real one
        if isinstance(optimizer, torch.optim.AdamW):
            names.add("adamw")
        elif isinstance(optimizer, torch.optim.Adam):
            names.add("adam")
        elif isinstance(optimizer, torch.optim.SGD):
            momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
            names.add("sgd_momentum" if momentum else "sgd")
        else:
            return None
    return names.pop() if len(names) == 1 else None


def communication_estimate(trainer: pl.Trainer, module: nn.Module) -> tuple[dict[str, Any] | None, str]:
    """Bytes per optimizer step and rank that the sharding plan moves, and the estimated model state;
    or ``None`` and the reason why there is no estimate.

    ``module`` is the live model: once sharded, the estimator reads the units it was sharded into."""
    plan = plan_of(trainer.strategy)
    if plan is None:
        if isinstance(trainer.strategy, FSDP2Strategy):
            return None, f"the estimator has no plan for reshard_after_forward={trainer.strategy._reshard_after_forward}"
        return None, f"no sharding plan known for {type(trainer.strategy).__name__}"
    optimizer = optimizer_name(trainer.optimizers)
    if optimizer is None:
        kinds = ", ".join(type(getattr(o, "_optimizer", o)).__name__ for o in trainer.optimizers)
        return None, f"the estimator knows Adam(W) and SGD, not {kinds or 'no optimizer'}"
    estimate = estimate_module(
        module,
        strategy=plan["strategy"],
        world_size=trainer.world_size,
        precision=str(trainer.precision),
        optimizer=optimizer,
        processes_per_node=plan["processes_per_node"],
        accumulate_grad_batches=trainer.accumulate_grad_batches,
    )
    return estimate_figures(estimate), ""


def estimate_figures(estimate: Estimate) -> dict[str, Any]:
    """The estimate's communication per step and the model state per rank, wherever it is kept:
    ``fsdp2_offload`` keeps it in host memory, and the measured state counts it there too."""
    return {
        "strategy": estimate.strategy,
        "all_gather_bytes": float(estimate.all_gather_bytes),
        "reduce_scatter_bytes": float(estimate.reduce_scatter_bytes),
        "all_reduce_bytes": float(estimate.all_reduce_bytes),
        "sent_bytes": float(estimate.sent_bytes),
        "estimated_model_state_bytes": float(estimate.model_state_bytes + estimate.host_bytes),
    }


# --- from per-rank rows to a summary --------------------------------------------------------------


def _value(x: float) -> float | None:
    return None if math.isnan(x) else x


def summarize(rows: list[dict[str, float]], *, peak_flops: float | None) -> dict[str, Any]:
    """Per-rank memory and throughput rows plus the run's totals.

    Samples and tokens per second are those of all ranks together over the slowest rank's time;
    TFLOP/s is per device (the mean over ranks), and MFU divides it by the device's peak."""
    ranks = []
    for rank, row in enumerate(rows):
        seconds = row["seconds"]
        timed = seconds > 0  # False for NaN as well
        ranks.append(
            {
                "rank": rank,
                **{field: _value(row[field]) for field in _FIELDS[:5]},
                "samples_per_sec": row["samples"] / seconds if timed else None,
                "tokens_per_sec": _value(row["tokens"] / seconds) if timed else None,
                "tflops_per_sec": _value(row["flops_per_batch"] * row["batches"] / seconds / 1e12) if timed else None,
            }
        )
    seconds = max((row["seconds"] for row in rows), default=math.nan)
    timed = seconds > 0
    per_device = [r["tflops_per_sec"] for r in ranks if r["tflops_per_sec"] is not None]
    tflops = sum(per_device) / len(per_device) if per_device and len(per_device) == len(ranks) else None
    return {
        "world_size": len(rows),
        "ranks": ranks,
        "measured_seconds": seconds if timed else None,
        "measured_batches": int(rows[0]["batches"]) if rows and timed else 0,
        "samples_per_sec": sum(row["samples"] for row in rows) / seconds if timed else None,
        "tokens_per_sec": _value(sum(row["tokens"] for row in rows) / seconds) if timed else None,
        "tflops_per_sec": tflops,
        "mfu": tflops * 1e12 / peak_flops if tflops is not None and peak_flops else None,
        "flops_per_batch": _value(rows[0]["flops_per_batch"]) if rows else None,
        "peak_tflops": peak_flops / 1e12 if peak_flops else None,
        "max_peak_rss_bytes": _max(ranks, "peak_rss_bytes"),
        "max_peak_allocated_bytes": _max(ranks, "peak_allocated_bytes"),
        "max_model_state_bytes": _max(ranks, "model_state_bytes"),
    }


def _max(ranks: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in ranks if r[field] is not None]
    return max(values) if values else None


def _bytes(value: float | None) -> str:
    return "n/a" if value is None else format_bytes(value)


def _number(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _significant(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in [header, *rows]]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return lines


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a table that reads well in a terminal."""
    cuda = any(r["peak_allocated_bytes"] is not None for r in summary["ranks"])
    header = ["rank", "peak RSS", "RSS growth"] + (["CUDA peak alloc", "CUDA peak reserved"] if cuda else [])
    header += ["model state", "samples/s", "tokens/s", "TFLOP/s"]
    rows = []
    for r in summary["ranks"]:
        row = [str(r["rank"]), _bytes(r["peak_rss_bytes"]), _bytes(r["rss_growth_bytes"])]
        if cuda:
            row += [_bytes(r["peak_allocated_bytes"]), _bytes(r["peak_reserved_bytes"])]
        row += [_bytes(r["model_state_bytes"]), _number(r["samples_per_sec"]), _number(r["tokens_per_sec"], 0),
                _significant(r["tflops_per_sec"])]
        rows.append(row)
    title = (
        f"ShardingMonitor: {summary.get('strategy', '?')} | {summary['world_size']} x {summary.get('device', '?')}"
        f" | {summary.get('precision', '?')} | {summary.get('steps', '?')} steps, throughput over"
        f" {summary['measured_batches']} batches (after {summary.get('warmup_steps', '?')} warm-up steps)"
    )
    if summary["mfu"] is not None:
        mfu = f"{summary['mfu']:.1%} of {summary['peak_tflops']:,.1f} TFLOP/s peak"
    elif summary["tflops_per_sec"] is not None:
        mfu = "n/a (device peak unknown: pass peak_tflops=)"
    else:
        mfu = "n/a"
    lines = [
        title,
        *_grid(header, rows),
        f"all ranks: {_number(summary['samples_per_sec'])} samples/s, {_number(summary['tokens_per_sec'], 0)} tokens/s;"
        f" per device {_significant(summary['tflops_per_sec'])} TFLOP/s, MFU {mfu}",
    ]
    if summary.get("all_gather_bytes") is not None:
        lines.append(
            f"communication per step and rank ({summary['strategy']} plan): all-gather"
            f" {_bytes(summary['all_gather_bytes'])}, reduce-scatter {_bytes(summary['reduce_scatter_bytes'])},"
            f" all-reduce {_bytes(summary['all_reduce_bytes'])}; ring sends {_bytes(summary['sent_bytes'])}"
        )
        lines.append(
            f"model state per rank: measured {_bytes(summary['max_model_state_bytes'])} (largest rank),"
            f" estimated {_bytes(summary['estimated_model_state_bytes'])}"
        )
    else:
        lines.append(f"communication per step: n/a ({summary.get('communication_note', 'no sharding plan')})")
    return "\n".join(lines)


# --- time -----------------------------------------------------------------------------------------


class _Clock:
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
class _Point:
    """Counters of one rank at a step boundary."""

    mark: Any
    samples: int
    tokens: int
    batches: int
    validation_seconds: float


# --- the callback ---------------------------------------------------------------------------------


class ShardingMonitor(Callback):
    """Logs per-rank peak memory, throughput, TFLOP/s, MFU and the sharding plan's communication
    while training, and prints a summary table when fit ends (also kept as ``self.summary``).

    Works with any strategy; communication figures come from the plan of ``"fsdp2"`` (and its
    variants) and ``"ddp"``. Logged keys (rank 0, every ``Trainer(log_every_n_steps=...)``):
    ``monitor/peak_rss_mib`` and ``monitor/rss_growth_mib`` (max over ranks), on CUDA
    ``monitor/peak_allocated_mib`` and ``monitor/peak_reserved_mib``, and since the previous log
    ``monitor/samples_per_sec``, ``monitor/tokens_per_sec`` (all ranks), ``monitor/tflops_per_sec``
    (per device) and ``monitor/mfu``.

    Args:
        warmup_steps: optimizer steps left out of throughput (allocation, compilation; the first
            step also counts FLOPs, which slows it).
        batch_size_fn: ``batch -> int`` samples in a batch; default: the first dimension of the
            batch's first tensor.
        tokens_fn: ``batch -> int`` tokens in a batch; default: the element count of the batch's
            first integer tensor with two or more dimensions (token ids, padding included).
        tokens_per_sample: tokens per sample, instead of ``tokens_fn``.
        peak_tflops: the device's peak TFLOP/s for MFU; default: Lightning's table of CUDA devices
            for the Trainer's precision (no peak is known for CPUs).
        count_flops: count the FLOPs of the first training batch with ``FlopCounterMode``.
        print_summary: print the summary table on rank 0 when fit ends.
    """

    def __init__(
        self,
        *,
        warmup_steps: int = 3,
        batch_size_fn: Callable[[Any], int] | None = None,
        tokens_fn: Callable[[Any], int] | None = None,
        tokens_per_sample: int | None = None,
        peak_tflops: float | None = None,
        count_flops: bool = True,
        print_summary: bool = True,
    ) -> None:
        _check_positive_int("warmup_steps", warmup_steps, accepted="a positive int")
        for option, fn in (("batch_size_fn", batch_size_fn), ("tokens_fn", tokens_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"`{option}` must be a callable batch -> int, or None; got {fn!r} of type {type(fn).__name__}."
                )
        if tokens_per_sample is not None:
            _check_positive_int("tokens_per_sample", tokens_per_sample, accepted="a positive int or None")
            if tokens_fn is not None:
                raise ValueError(
                    f"Pass `tokens_fn` or `tokens_per_sample`, not both; got tokens_fn={tokens_fn!r} and"
                    f" tokens_per_sample={tokens_per_sample!r}."
                )
        if peak_tflops is not None:
            if isinstance(peak_tflops, bool) or not isinstance(peak_tflops, (int, float)):
                raise TypeError(
                    f"`peak_tflops` must be a positive number (the device's peak TFLOP/s) or None; got"
                    f" {peak_tflops!r} of type {type(peak_tflops).__name__}."
                )
            if not math.isfinite(peak_tflops) or peak_tflops <= 0:
                raise ValueError(
                    f"`peak_tflops` must be a positive number (the device's peak TFLOP/s) or None; got {peak_tflops!r}."
                )
        for option, value in (("count_flops", count_flops), ("print_summary", print_summary)):
            if not isinstance(value, bool):
                raise TypeError(f"`{option}` must be a bool; got {value!r} of type {type(value).__name__}.")
        self.warmup_steps = warmup_steps
        self.batch_size_fn = batch_size_fn
        self.tokens_fn = tokens_fn
        self.tokens_per_sample = tokens_per_sample
        self.peak_tflops = None if peak_tflops is None else float(peak_tflops)
        self.count_flops = count_flops
        self.print_summary = print_summary
        self.summary: dict[str, Any] | None = None
        self._reset()

    def _reset(self) -> None:
        self._clock: _Clock | None = None
        self._rss_at_start: int | None = None
        self._flop_counter: FlopCounterMode | None = None
        self._flops_per_batch = math.nan
        self._samples = self._tokens = self._batches = 0
        self._tokens_known = True
        self._warned: set[str] = set()
        self._first_step = self._last_step = 0
        self._window_start: _Point | None = None
        self._latest: _Point | None = None
        self._last_log: _Point | None = None
        self._validation_seconds = 0.0
        self._validation_start: Any = None
        self._state_bytes = math.nan
        self._communication: dict[str, Any] | None = None
        self._communication_note = ""

    # --- hooks ---

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before configure_model, sharding and the optimizers: their memory counts as the fit's.
        if stage != "fit":
            return
        self._reset()
        self.summary = None
        device = trainer.strategy.root_device
        self._clock = _Clock(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        reset_peak_rss()
        self._rss_at_start = current_rss_bytes()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = self._last_step = trainer.global_step  # not 0 when resuming
        try:
            self._communication, self._communication_note = communication_estimate(trainer, pl_module)
        except Exception as error:  # a monitor must not stop training
            self._communication_note = f"estimate failed: {error}"
            rank_zero_warn(f"ShardingMonitor: the communication estimate failed: {error}")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.count_flops and math.isnan(self._flops_per_batch) and self._flop_counter is None:
            self._flop_counter = FlopCounterMode(display=False)
            self._flop_counter.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._flop_counter is not None:
            self._stop_counting_flops()
        self._count(batch)
        if trainer.global_step == self._last_step:
            return  # accumulating gradients: not a step boundary
        self._last_step = trainer.global_step
        assert self._clock is not None
        point = _Point(self._clock.mark(), self._samples, self._tokens, self._batches, self._validation_seconds)
        if self._window_start is None:
            if trainer.global_step - self._first_step >= self.warmup_steps:
                self._window_start = self._latest = self._last_log = point
                self._state_bytes = self._measure_state(trainer, pl_module)
        else:
            self._latest = point
        every = trainer.log_every_n_steps
        if trainer.loggers and every > 0 and trainer.global_step % every == 0:
            self._log_interval(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._window_start is not None and not trainer.sanity_checking and self._clock is not None:
            self._validation_start = self._clock.mark()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None and self._clock is not None:
            self._validation_seconds += self._clock.seconds(self._validation_start, self._clock.mark())
            self._validation_start = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._flop_counter is not None:
            self._stop_counting_flops()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank reaches this hook and gathers unconditionally: nothing rank-local decides
        # whether the collective runs, so no rank can leave the others waiting in it.
        if self._flop_counter is not None:  # the epoch ended early, inside the counted batch
            self._stop_counting_flops()
        self._state_bytes = _nanmax(self._state_bytes, self._measure_state(trainer, pl_module))
        rows = self._gather(trainer, self._row(trainer, self._window_start, self._latest))
        precision = str(trainer.precision)
        device = trainer.strategy.root_device
        summary = summarize(rows, peak_flops=peak_flops_per_device(device, precision, self.peak_tflops))
        summary.update(
            strategy=(self._communication or {}).get("strategy") or _strategy_label(trainer.strategy),
            device=device.type,
            precision=precision,
            steps=trainer.global_step,
            warmup_steps=self.warmup_steps,
            all_gather_bytes=None,
            reduce_scatter_bytes=None,
            all_reduce_bytes=None,
            sent_bytes=None,
            estimated_model_state_bytes=None,
            communication_note=self._communication_note,
        )
        if self._communication is not None:
            summary.update({k: v for k, v in self._communication.items() if k != "strategy"})
        self.summary = summary
        if trainer.is_global_zero and trainer.loggers:
            metrics = {
                "monitor/model_state_mib": summary["max_model_state_bytes"],
                "monitor/estimated_model_state_mib": summary["estimated_model_state_bytes"],
                "monitor/all_gather_mib_per_step": summary["all_gather_bytes"],
                "monitor/reduce_scatter_mib_per_step": summary["reduce_scatter_bytes"],
                "monitor/all_reduce_mib_per_step": summary["all_reduce_bytes"],
            }
            self._log(trainer, {k: v / MiB for k, v in metrics.items() if v is not None})

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Printed here, after the progress bars have closed.
        if self.print_summary and trainer.is_global_zero and self.summary is not None:
            print(format_summary(self.summary), flush=True)

    # --- helpers ---

    def _stop_counting_flops(self) -> None:
        counter, self._flop_counter = self._flop_counter, None
        assert counter is not None
        counter.__exit__(None, None, None)
        self._flops_per_batch = float(counter.get_total_flops())

    def _count(self, batch: Any) -> None:
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
        self._samples += samples
        self._batches += 1
        if self.tokens_fn is not None:
            self._tokens += _call_counter("tokens_fn", self.tokens_fn, batch)
        elif self.tokens_per_sample is not None:
            self._tokens += samples * self.tokens_per_sample
        else:
            tokens, ambiguous = tokens_of(batch)
            if ambiguous:
                self._warn_once(
                    "tokens",
                    "ShardingMonitor: the batch holds integer tensors of different sizes, so tokens/s is not"
                    " reported. Pass `tokens_fn` or `tokens_per_sample`.",
                )
            if tokens is None:
                self._tokens_known = False
            else:
                self._tokens += tokens

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def _measure_state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        return float(model_state_bytes(pl_module, optimizers))

    def _row(self, trainer: pl.Trainer, start: _Point | None, end: _Point | None) -> dict[str, float]:
        row = {**peak_memory(trainer.strategy.root_device, self._rss_at_start), "model_state_bytes": self._state_bytes}
        row.update(dict.fromkeys(("samples", "tokens", "batches", "seconds"), math.nan))
        row["flops_per_batch"] = self._flops_per_batch
        if start is not None and end is not None and end.batches > start.batches:
            assert self._clock is not None
            validation = end.validation_seconds - start.validation_seconds
            row.update(
                samples=end.samples - start.samples,
                tokens=end.tokens - start.tokens if self._tokens_known else math.nan,
                batches=end.batches - start.batches,
                seconds=self._clock.seconds(start.mark, end.mark) - validation,
            )
        return row

    def _gather(self, trainer: pl.Trainer, row: dict[str, float]) -> list[dict[str, float]]:
        mine = torch.tensor([row[field] for field in _FIELDS], dtype=torch.float64, device=trainer.strategy.root_device)
        rows = [mine]
        if dist.is_available() and dist.is_initialized():
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
        return [dict(zip(_FIELDS, values)) for values in torch.stack(rows).cpu().tolist()]

    def _log_interval(self, trainer: pl.Trainer) -> None:
        """Reduces every rank's numbers since the previous log (a collective: all ranks call it)."""
        rows = self._gather(trainer, self._row(trainer, self._last_log, self._latest))
        self._last_log = self._latest
        if not trainer.is_global_zero:
            return
        peak = peak_flops_per_device(trainer.strategy.root_device, str(trainer.precision), self.peak_tflops)
        summary = summarize(rows, peak_flops=peak)
        metrics = {
            f"monitor/{name}_mib": _max(summary["ranks"], f"{name}_bytes")
            for name in ("peak_rss", "rss_growth", "peak_allocated", "peak_reserved")
        }
        metrics = {k: v / MiB for k, v in metrics.items() if v is not None}
        for name in ("samples_per_sec", "tokens_per_sec", "tflops_per_sec", "mfu"):
            if summary[name] is not None:
                metrics[f"monitor/{name}"] = summary[name]
        self._log(trainer, metrics)

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        # Lightning logs the metrics of the step that completes step N under N - 1; so do we.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=max(trainer.global_step - 1, 0))


def _nanmax(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def _strategy_label(strategy: Any) -> str:
    return getattr(strategy, "strategy_name", None) or type(strategy).__name__

