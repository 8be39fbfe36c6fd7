"""``Trainer(precision=...)`` as FSDP2 mixed-precision policies (pure torch; the Lightning plugins that run it on
shards are :mod:`fsdp_strategy.plugins.precision`).

``*-mixed`` keeps fp32 sharded master weights: FSDP2 all-gathers them in the low-precision dtype for
compute and reduce-scatters gradients in fp32. Autocast stays on as under DDP, and normalization
layers keep fp32 parameters (their own unit with :data:`FULL_PRECISION_POLICY`), because bf16
gradients of norm weights are what makes plain bf16 compute drift from an fp32 run (about 3x the
distance that DDP with autocast reaches).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["FULL_PRECISION_POLICY", "is_normalization", "mixed_precision_policy"]

# The norms' inputs are cast to fp32 by a hook of the strategy's own (parallelize.cast_inputs), not by FSDP: before
# torch 2.13 FSDP skipped that cast when activation checkpointing recomputed a norm inside a block, and the
# recomputed tensors no longer matched the forward's.
FULL_PRECISION_POLICY = MixedPrecisionPolicy(
    param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
)

# Class names cover torch's norms and the many re-implementations (LlamaRMSNorm, T5LayerNorm, ...).
_NORM_CLASS_NAME = re.compile(r"Norm")


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """The FSDP2 policy for a ``*-mixed`` precision string; ``None`` for the ``*-true`` ones."""
    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if low is None:
        return None
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def is_normalization(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer that owns parameters (kept in fp32 under ``*-mixed``)."""
    return bool(_NORM_CLASS_NAME.search(type(module).__name__)) and any(True for _ in module.parameters(recurse=False))
