"""What the launcher (:mod:`~fsdp_strategy.tools.benchmark.run`) and each worker process
(:mod:`~fsdp_strategy.tools.benchmark.worker`) agree on: the strategies and precisions a job may ask for, the
model named as ``MODULE:Class``, and the progress line a worker prints. Both import it; neither imports the
other (the launcher starts workers by module name, in fresh processes)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import lightning as L

from fsdp_strategy.estimator.target import load_target

__all__ = ["PRECISIONS", "PROGRESS_PREFIX", "STRATEGIES", "Variant", "load_model_class", "parse_variant"]

STRATEGIES = ("ddp", "fsdp2", "fsdp2_grad_op", "model_parallel", "raw_fsdp2")
PRECISIONS = ("32-true", "bf16-mixed")
PROGRESS_PREFIX = "[fsdp-strategy-benchmark] batch"  # the worker's rank-0 progress lines
SHARDED = ("fsdp2", "fsdp2_grad_op")  # FSDP2Strategy under its registered names: these take variants
INITS = ("eager", "meta")


@dataclass(frozen=True)
class Variant:
    """A ``--strategies`` entry: ``fsdp2`` as registered, or ``fsdp2:host_memory=keep:init=meta`` (an A/B
    candidate beside the plain one): ``FSDP2Strategy`` options, and ``init=meta`` to build the model inside
    ``trainer.init_module(empty_init=True)`` rather than eagerly."""

    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    init: str = "eager"


def parse_variant(text: str) -> Variant:
    name, *settings = text.split(":")
    if name not in STRATEGIES:
        raise ValueError(f"`--strategies`: {name!r} is not one of {', '.join(STRATEGIES)}.")
    if settings and name not in SHARDED:
        raise ValueError(f"`--strategies`: {text!r}: only {', '.join(SHARDED)} take ':option=value' settings.")
    options: dict[str, Any] = {}
    init = "eager"
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"`--strategies`: {text!r}: settings are ':option=value'; got {setting!r}.")
        if key == "init":
            if value not in INITS:
                raise ValueError(f"`--strategies`: {text!r}: init must be one of {', '.join(INITS)}; got {value!r}.")
            init = value
            continue
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value  # a bare word is a string
    return Variant(name, options, init)


def load_model_class(spec: str) -> type[L.LightningModule]:
    """The LightningModule class named by ``MODULE:Class``; ``ValueError`` naming the spec otherwise."""
    cls = load_target(spec)
    if not issubclass(cls, L.LightningModule):
        raise ValueError(f"`--model` {spec!r} must name a LightningModule subclass; it is {cls!r}.")
    return cls
