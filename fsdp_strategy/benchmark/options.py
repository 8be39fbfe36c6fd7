"""What the launcher (:mod:`~fsdp_strategy.benchmark.run`) and each worker process
(:mod:`~fsdp_strategy.benchmark.worker`) agree on: the strategies and precisions a job may ask for, the
model named as ``MODULE:Class``, and the progress line a worker prints. Both import it; neither imports the
other (the launcher starts workers by module name, in fresh processes)."""

from __future__ import annotations

import lightning as L

from fsdp_strategy.target import load_target

__all__ = ["PRECISIONS", "PROGRESS_PREFIX", "STRATEGIES", "load_model_class"]

STRATEGIES = ("ddp", "fsdp2", "fsdp2_grad_op", "model_parallel", "raw_fsdp2")
PRECISIONS = ("32-true", "bf16-mixed")
PROGRESS_PREFIX = "[fsdp-strategy-benchmark] batch"  # the worker's rank-0 progress lines


def load_model_class(spec: str) -> type[L.LightningModule]:
    """The LightningModule class named by ``MODULE:Class``; ``ValueError`` naming the spec otherwise."""
    cls = load_target(spec)
    if not issubclass(cls, L.LightningModule):
        raise ValueError(f"`--model` {spec!r} must name a LightningModule subclass; it is {cls!r}.")
    return cls
