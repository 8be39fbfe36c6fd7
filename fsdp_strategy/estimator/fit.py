"""The simplest setting that fits a memory budget per rank: strategy, activation checkpointing, micro-batch size.

Settings are tried simplest first, and the first whose traced step peak fits is recommended
(:func:`fit_budget`). The ladder: the whole batch per forward without activation checkpointing, in
:data:`~fsdp_strategy.estimator.report.RECOMMENDATION_ORDER` (``ddp`` first), then the same with activation
checkpointing (when a policy is given), then smaller micro-batches (the divisors of the batch size, largest
first) with gradient accumulation keeping the batch per optimizer step. Sharding changes no result and costs
communication that overlaps compute; recomputation costs about a third more compute; smaller micro-batches
use the device less well. Every setting tried before the chosen one is named with its peak: that is why it
was rejected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fsdp_strategy.estimator.model_state import Estimate
from fsdp_strategy.estimator.peak import StepPeaks
from fsdp_strategy.sizes import format_bytes

__all__ = ["Recommendation", "fit_budget", "micro_batch_sizes"]


@dataclass(frozen=True)
class Recommendation:
    """The simplest setting that fits the budget at one world size (``strategy`` ``None`` when none fits).

    ``micro_batch_size``, ``accumulate_grad_batches`` and ``activation_checkpointing`` are set when the
    estimate traced a batch; ``accumulate_grad_batches`` is then the Trainer's value for that setting.
    """

    world_size: int
    strategy: str | None
    reason: str
    micro_batch_size: int | None = None
    accumulate_grad_batches: int | None = None
    activation_checkpointing: bool | None = None
    peak_bytes: int | None = None


def micro_batch_sizes(batch_size: int) -> list[int]:
    """The sizes that split ``batch_size`` into equal micro-batches, largest first."""
    return [size for size in range(batch_size, 0, -1) if batch_size % size == 0]


def _setting(micro_batch_size: int, accumulate: int, checkpointed: bool) -> str:
    text = f"micro-batch {micro_batch_size}"
    text += f" x {accumulate} accumulated" if accumulate > 1 else ""
    return text + (" with activation checkpointing" if checkpointed else "")


def fit_budget(
    estimate_for: Callable[[str, int], Estimate],
    peaks: StepPeaks,
    *,
    world_size: int,
    strategies: Sequence[str],
    batch_size: int,
    accumulate: int,
    budget: int,
) -> Recommendation:
    """The first setting of the ladder (see the module) whose peak fits ``budget`` bytes per rank.

    ``estimate_for(strategy, accumulate_grad_batches)`` estimates one strategy at ``world_size``; ``batch_size``
    samples per rank go through each optimizer step ``accumulate`` times (the Trainer's own accumulation).
    """
    limit = format_bytes(budget)
    rejected: list[str] = []
    for micro in micro_batch_sizes(batch_size):
        steps = accumulate * (batch_size // micro)
        for checkpointed in (False, True) if peaks.activation_checkpointing is not None else (False,):
            needs = []
            for strategy in strategies:
                estimate = estimate_for(strategy, steps)
                peak = peaks.peak(estimate, micro_batch_size=micro, checkpointed=checkpointed, accumulate=steps).bytes
                setting = _setting(micro, steps, checkpointed)
                if peak > budget:
                    needs.append(f"{strategy} {format_bytes(peak)}")
                    continue
                if needs:
                    rejected.append(f"{setting}: {', '.join(needs)}")
                why = f"{strategy} at {setting} needs {format_bytes(peak)} per rank <= {limit} budget"
                why += f"; over the budget: {'; '.join(rejected)}" if rejected else ", and it is the simplest"
                return Recommendation(world_size, strategy, why, micro, steps, checkpointed, peak)
            rejected.append(f"{_setting(micro, steps, checkpointed)}: {', '.join(needs)}")
    return Recommendation(
        world_size,
        None,
        f"nothing fits the {limit} budget per rank even at micro-batch 1 ({rejected[-1]}); use more ranks, a lower"
        " precision or a lighter optimizer",
    )
