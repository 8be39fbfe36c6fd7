"""``Trainer(precision=...)`` -> FSDP2 mixed-precision policy and Lightning precision plugin."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fsdp_strategy.plugins.precision import (
    SUPPORTED_PRECISIONS,
    FSDP2DoublePrecision,
    FSDP2HalfPrecision,
    FSDP2MixedPrecision,
    FSDP2Precision,
    precision_plugin_for,
)
from fsdp_strategy.sharding.mixed_precision import FULL_PRECISION_POLICY, is_normalization, mixed_precision_policy
from testkit.models import TinyLM, token_loader

# What each precision keeps the trained parameters in: fp32 for full and mixed precision, the low dtype for "-true".
_PARAMETER_DTYPE = {
    "32-true": torch.float32,
    "bf16-mixed": torch.float32,
    "16-mixed": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
    "64-true": torch.float64,
}


@pytest.mark.parametrize("precision", SUPPORTED_PRECISIONS)
def test_each_listed_precision_trains_a_step(trainer_env, precision):
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="fsdp2",
        precision=precision,
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module():  # "-true" precisions build the module in their dtype
        # SGD: AdamW's eps of 1e-8 is 0 in fp16, and a zero second moment then divides by zero under "16-true" (as
        # it does without sharding). On CPU Lightning runs "16-mixed" as "bf16-mixed" (with a warning).
        model = TinyLM(optimizer="sgd", n_layer=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.fit(model, token_loader(samples=4))
    assert trainer.global_step == 1
    after = dict(model.named_parameters())
    assert {p.dtype for p in after.values()} == {_PARAMETER_DTYPE[precision]}, precision
    assert all(p.isfinite().all() for p in after.values()), precision
    assert any(not torch.equal(after[name].detach(), value) for name, value in before.items()), "the step moved nothing"


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
        ("64-true", FSDP2DoublePrecision),
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


@pytest.mark.parametrize("precision", ["transformer-engine", "bf16"])
def test_unsupported_precision_lists_the_supported_ones(precision):
    message = (
        f"`Trainer(precision={precision!r})` is not supported by the FSDP2 strategy. Choose one of:"
        " 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true."
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
