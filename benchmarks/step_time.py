"""Step timing shared by the scripts in ``benchmarks/`` (``multinode_step_time.py``, ``paired_steps.py``).

The side-by-side step-time comparison of ``fsdp2``, a raw FSDP2 loop and ``ModelParallelStrategy`` that used to
live here is ``fsdp-strategy benchmark`` now (``fsdp_strategy/tools/benchmark/``, results in ``docs/benchmarks.md``);
the batches come from there too.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fsdp_strategy.tools.benchmark.worker import batches_per_run as total_steps
from fsdp_strategy.tools.benchmark.worker import token_loader

__all__ = ["StepClock", "model_kwargs", "token_loader", "total_steps"]


def model_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        vocab_size=args.vocab_size,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )


class StepClock:
    """Wall time (``perf_counter``) and this process's CPU time (``process_time``, all its threads) at each
    batch start and end. On an oversubscribed machine the CPU time a step consumes moves much less with other
    jobs' load than its wall time does, so both are reported."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.cpu_starts: list[float] = []
        self.losses: list[float] = []

    def start(self) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def end(self, loss: float) -> None:
        self.ends.append(time.perf_counter())
        self.losses.append(loss)

    def summary(self, warmup: int, steps: int) -> dict:
        """Step ``i`` lasts from its batch start to the next one's, so it includes everything the loop does."""
        timed = range(warmup, warmup + steps)
        periods = [self.starts[i + 1] - self.starts[i] for i in timed]
        cpu = [self.cpu_starts[i + 1] - self.cpu_starts[i] for i in timed]
        q = statistics.quantiles(periods, n=10)
        return {
            "median_s": statistics.median(periods),
            "mean_s": statistics.fmean(periods),
            "p10_s": q[0],
            "p90_s": q[-1],
            "min_s": min(periods),
            "median_inner_s": statistics.median(self.ends[i] - self.starts[i] for i in timed),
            "median_cpu_s": statistics.median(cpu),
            "step_times_s": periods,
            "step_cpu_s": cpu,
            "loss_first": self.losses[0],
            "loss_last_timed": self.losses[warmup + steps - 1],
        }
