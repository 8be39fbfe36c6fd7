"""``ShardingMonitor``, the callback: Lightning's hooks reset the peaks, count and time batches, count
one batch's FLOPs, measure the model state, and gather every rank's numbers into the summary."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from fsdp_strategy.monitor.batches import BatchCounter
from fsdp_strategy.monitor.flops import BatchFlops, peak_flops_per_device
from fsdp_strategy.monitor.live import LiveTensorPeak
from fsdp_strategy.monitor.memory import current_rss_bytes, peak_memory, reset_peaks
from fsdp_strategy.monitor.plan_costs import communication_estimate
from fsdp_strategy.monitor.summary import (
    format_summary,
    gather_rows,
    max_over_ranks,
    summarize,
)
from fsdp_strategy.monitor.timing import Clock, Point, between
from fsdp_strategy.option_checks import check_positive_int
from fsdp_strategy.sharding.state_bytes import model_state_bytes

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ShardingMonitor"]

MiB = 2**20


class ShardingMonitor(Callback):
    """Logs per-rank peak memory, throughput, TFLOP/s, MFU and the sharding plan's communication
    while training, and prints a summary table when fit ends (also kept as ``self.summary``).

    Works with any strategy; communication figures come from the plan of ``"fsdp2"`` (and its
    variants) and ``"ddp"``. Logged keys (rank 0, every ``Trainer(log_every_n_steps=...)``):
    ``monitor/peak_rss_mib``, ``monitor/rss_growth_mib`` and ``monitor/live_peak_mib`` (max over ranks), on CUDA
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
        live_tensor_steps: count the bytes of live tensors (:mod:`fsdp_strategy.monitor.live`) during this
            many first optimizer steps and report their peak; 0: do not count.
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
        live_tensor_steps: int = 2,
    ) -> None:
        check_positive_int("warmup_steps", warmup_steps, accepted="a positive int")
        for option, fn in (("batch_size_fn", batch_size_fn), ("tokens_fn", tokens_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"`{option}` must be a callable batch -> int, or None; got {fn!r} of type {type(fn).__name__}."
                )
        if tokens_per_sample is not None:
            check_positive_int("tokens_per_sample", tokens_per_sample, accepted="a positive int or None")
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
        accepted = "an int >= 0 (0: do not count live tensors)"
        if isinstance(live_tensor_steps, bool) or not isinstance(live_tensor_steps, int):
            raise TypeError(
                f"`live_tensor_steps` must be {accepted}; got {live_tensor_steps!r} of type {type(live_tensor_steps).__name__}."
            )
        if live_tensor_steps < 0:
            raise ValueError(f"`live_tensor_steps` must be {accepted}; got {live_tensor_steps}.")
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
        self.live_tensor_steps = live_tensor_steps
        self.summary: dict[str, Any] | None = None
        self._reset()

    def _reset(self) -> None:
        self._clock: Clock | None = None
        self._rss_at_start: int | None = None
        self._flops = BatchFlops()
        self._live = LiveTensorPeak(self.live_tensor_steps)
        self._counts = BatchCounter(
            batch_size_fn=self.batch_size_fn, tokens_fn=self.tokens_fn, tokens_per_sample=self.tokens_per_sample
        )
        self._first_step = self._last_step = 0
        self._window_start: Point | None = None
        self._latest: Point | None = None
        self._last_log: Point | None = None
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
        self._clock = Clock(device)
        self._live = LiveTensorPeak(self.live_tensor_steps, device=device.type)
        self._live.collect()
        reset_peaks(device)
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
        # Modes nest: live tensors are counted outside the FLOP counter, which stops first.
        self._live.start(trainer.global_step)
        if self.count_flops:
            self._flops.start()  # the first batch only

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._flops.stop()
        self._live.stop(trainer.global_step)
        self._counts.count(batch)
        if trainer.global_step == self._last_step:
            return  # accumulating gradients: not a step boundary
        self._last_step = trainer.global_step
        assert self._clock is not None
        counts = self._counts
        point = Point(self._clock.mark(), counts.samples, counts.tokens, counts.batches, self._validation_seconds)
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
        self._flops.stop()
        self._live.stop()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank reaches this hook and gathers unconditionally: nothing rank-local decides
        # whether the collective runs, so no rank can leave the others waiting in it.
        self._flops.stop()  # in case the epoch ended early, inside the counted batch
        self._live.stop()  # fewer steps than live_tensor_steps
        self._state_bytes = _nanmax(self._state_bytes, self._measure_state(trainer, pl_module))
        rows = gather_rows(self._row(trainer, self._window_start, self._latest), trainer.strategy.root_device)
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
            mesh=None,
            tensor_parallel_all_reduce_bytes=None,
            estimate_note="",
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

    def _measure_state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        return float(model_state_bytes(pl_module, optimizers))

    def _row(self, trainer: pl.Trainer, start: Point | None, end: Point | None) -> dict[str, float]:
        return {
            **peak_memory(trainer.strategy.root_device, self._rss_at_start),
            **self._live.state(),
            "model_state_bytes": self._state_bytes,
            **between(self._clock, start, end, tokens_known=self._counts.tokens_known),
            "flops_per_batch": self._flops.per_batch,
        }

    def _log_interval(self, trainer: pl.Trainer) -> None:
        """Reduces every rank's numbers since the previous log (a collective: all ranks call it)."""
        rows = gather_rows(self._row(trainer, self._last_log, self._latest), trainer.strategy.root_device)
        self._last_log = self._latest
        if not trainer.is_global_zero:
            return
        peak = peak_flops_per_device(trainer.strategy.root_device, str(trainer.precision), self.peak_tflops)
        summary = summarize(rows, peak_flops=peak)
        metrics = {
            f"monitor/{name}_mib": max_over_ranks(summary["ranks"], f"{name}_bytes")
            for name in ("peak_rss", "rss_growth", "live_peak", "peak_allocated", "peak_reserved")
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
