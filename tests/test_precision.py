"""``Trainer(precision=...)`` -> FSDP2 mixed-precision policy and Lightning precision plugin."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fsdp_strategy.sharding.precision import (
    FULL_PRECISION_POLICY,
    SUPPORTED_PRECISIONS,
    FSDP2HalfPrecision,
    FSDP2MixedPrecision,
    FSDP2Precision,
    is_normalization,
    mixed_precision_policy,
    precision_plugin_for,
)


def test_supported_precisions_are_the_documented_five():
    assert SUPPORTED_PRECISIONS == ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


@pytest.mark.parametrize(
    ("precision", "param_dtype"),
    [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)],
)
def test_mixed_precisions_compute_low_and_reduce_in_fp32(precision, param_dtype):
    policy = mixed_precision_policy(precision)
    assert policy is not None
    assert policy.param_dtype == param_dtype
    assert policy.reduce_dtype == torch.float32


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "16-true", "64-true"])
def test_non_mixed_precisions_have_no_mixed_precision_policy(precision):
    assert mixed_precision_policy(precision) is None


def test_full_precision_policy_keeps_fp32():
    assert FULL_PRECISION_POLICY.param_dtype == torch.float32
    assert FULL_PRECISION_POLICY.reduce_dtype == torch.float32


@pytest.mark.parametrize(
    ("precision", "plugin_type"),
    [
        ("32-true", FSDP2Precision),
        ("bf16-mixed", FSDP2MixedPrecision),
        ("16-mixed", FSDP2MixedPrecision),
        ("bf16-true", FSDP2HalfPrecision),
        ("16-true", FSDP2HalfPrecision),
    ],
)
def test_precision_plugin_table(precision, plugin_type):
    plugin = precision_plugin_for(precision, "cpu")
    assert type(plugin) is plugin_type
    assert plugin.precision == precision


def test_fp16_mixed_gets_a_sharded_grad_scaler():
    plugin = precision_plugin_for("16-mixed", "cpu")
    assert isinstance(plugin.scaler, ShardedGradScaler)
    assert plugin.device == "cpu"


def test_bf16_mixed_needs_no_grad_scaler():
    plugin = precision_plugin_for("bf16-mixed", "cpu")
    assert plugin.scaler is None


@pytest.mark.parametrize("precision", ["64-true", "transformer-engine", "bf16"])
def test_unsupported_precision_lists_the_supported_ones(precision):
    message = (
        f"`Trainer(precision={precision!r})` is not supported by the FSDP2 strategy. Choose one of:"
        " 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        precision_plugin_for(precision, "cpu")


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_half_precisions_also_build_modules_in_the_low_dtype(precision, dtype):
    with precision_plugin_for(precision, "cpu").module_init_context():
        layer = nn.Linear(2, 2)
    assert layer.weight.dtype == dtype
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (nn.LayerNorm(4), True),
        (nn.RMSNorm(4), True),
        (nn.GroupNorm(2, 4), True),
        (nn.BatchNorm1d(4), True),
        (nn.LayerNorm(4, elementwise_affine=False), False),  # no parameters to keep in fp32
        (nn.Linear(4, 4), False),
    ],
)
def test_is_normalization(module, expected):
    assert is_normalization(module) is expected


def test_is_normalization_recognizes_reimplemented_norms_by_class_name():
    class LlamaRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    assert is_normalization(LlamaRMSNorm())
