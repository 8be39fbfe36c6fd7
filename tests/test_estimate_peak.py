"""The step peak with activations: traced on fake tensors and replayed per plan (the comparison with the live tensors
of real fits is in integration_tests/test_estimate_peak.py and test_allocator_peak.py)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist

from fsdp_strategy.estimator.fit import Recommendation, fit_budget, micro_batch_sizes
from fsdp_strategy.estimator.model_state import Estimate, estimate_module
from fsdp_strategy.estimator.peak import StepPeaks
from fsdp_strategy.estimator.report import build_on_meta, estimate
from fsdp_strategy.estimator.trace import token_batch
from fsdp_strategy.sharding.policy import normalize_policy
from fsdp_strategy.tools.benchmark.gpt import GPT
from fsdp_strategy.tools.cli import main
from testkit.models import SEQ, TinyLM

GPT_ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}


def test_tracing_needs_no_memory_and_no_process_group():
    assert not dist.is_initialized()
    big = {"n_layer": 4, "n_head": 16, "n_embd": 4096, "block_size": 2048}  # 0.8B parameters: 3 GiB in fp32
    (row,) = estimate(GPT, init_args=big, world_sizes=[8], strategies=["fsdp2"], batch_size=2, seq_len=2048).rows
    assert row.step_peak_bytes > row.model_state_bytes + row.activation_bytes > 3 * 2**30 // 8
    assert not dist.is_initialized()


def test_activations_grow_with_the_batch_and_checkpointing_keeps_fewer():
    peaks = StepPeaks(
        lambda: build_on_meta(GPT, GPT_ARGS),
        lambda n: token_batch(n, 32),
        precision="32-true",
        activation_checkpointing=normalize_policy(["Block"], option="activation_checkpointing"),
    )
    row = estimate(GPT, init_args=GPT_ARGS, world_sizes=[2], strategies=["fsdp2"]).rows[0]
    small, large = (peaks.peak(row, micro_batch_size=n) for n in (2, 8))
    assert large.activation_bytes > 3 * small.activation_bytes
    assert peaks.peak(row, micro_batch_size=8, checkpointed=True).bytes < large.bytes


def test_sharding_lowers_the_peak_and_checkpointing_is_reported_beside_it():
    report = estimate(
        GPT,
        init_args=GPT_ARGS,
        world_sizes=[2],
        batch_size=4,
        seq_len=32,
        activation_checkpointing="auto",
        strategies=["ddp", "fsdp2_grad_op", "fsdp2"],
    )
    peaks = {r.strategy: r for r in report.rows}
    assert peaks["fsdp2"].peak_bytes < peaks["fsdp2_grad_op"].peak_bytes < peaks["ddp"].peak_bytes
    assert all(r.checkpointed_peak_bytes < r.step_peak_bytes for r in report.rows)
    assert report.batch_size == 4 and report.activation_checkpointing == '"auto"'
    header = next(line for line in report.table().splitlines() if line.startswith("strategy"))
    assert "activations  peak*  checkpointed*" in re.sub(" +", "  ", header)


def test_micro_batch_sizes_divide_the_batch_largest_first():
    assert micro_batch_sizes(12) == [12, 6, 4, 3, 2, 1]
    assert micro_batch_sizes(1) == [1]


@functools.cache
def _steps(checkpointing: bool = True) -> StepPeaks:
    # One per policy for the module: it keeps each micro-batch size's trace, and the traces are what takes time.
    policy = normalize_policy(["Block"], option="activation_checkpointing") if checkpointing else None
    return StepPeaks(
        lambda: build_on_meta(GPT, GPT_ARGS),
        lambda n: token_batch(n, 32),
        precision="32-true",
        activation_checkpointing=policy,
    )


def _estimate_for(strategy: str, accumulate: int) -> Estimate:
    return estimate_module(
        build_on_meta(GPT, GPT_ARGS), strategy=strategy, world_size=2, accumulate_grad_batches=accumulate
    )


def _fit(budget: int, checkpointing: bool = True) -> Recommendation:
    """A batch of 8 per rank, ddp or fsdp2 at 2 ranks."""
    return fit_budget(
        _estimate_for,
        _steps(checkpointing),
        world_size=2,
        strategies=["ddp", "fsdp2"],
        batch_size=8,
        accumulate=1,
        budget=budget,
    )


def _peak(strategy: str, micro: int, checkpointed: bool) -> int:
    accumulate = 8 // micro
    return (
        _steps()
        .peak(
            _estimate_for(strategy, accumulate),
            micro_batch_size=micro,
            checkpointed=checkpointed,
            accumulate=accumulate,
        )
        .bytes
    )


def test_the_budget_picks_sharding_then_checkpointing_then_smaller_micro_batches():
    ddp, fsdp2 = _peak("ddp", 8, False), _peak("fsdp2", 8, False)
    assert _fit(ddp).strategy == "ddp"
    sharded = _fit(fsdp2)
    assert (sharded.strategy, sharded.micro_batch_size, sharded.activation_checkpointing) == ("fsdp2", 8, False)
    checkpointed = _fit(fsdp2 - 1)
    assert checkpointed.activation_checkpointing and checkpointed.micro_batch_size == 8
    assert checkpointed.peak_bytes == _peak(checkpointed.strategy, 8, True) <= fsdp2 - 1
    assert "over the budget: micro-batch 8: ddp " in checkpointed.reason
    # Without a checkpointing policy the ladder goes to smaller micro-batches, accumulating to keep the batch.
    accumulated = _fit(fsdp2 - 1, checkpointing=False)
    assert accumulated.micro_batch_size == 4 and accumulated.accumulate_grad_batches == 2
    assert accumulated.reason.startswith(f"{accumulated.strategy} at micro-batch 4 x 2 accumulated needs ")


def test_nothing_fits_names_the_smallest_setting():
    rec = _fit(2**10)
    assert rec.strategy is None
    assert rec.reason.startswith(
        "nothing fits the 1.0 KiB budget per rank even at micro-batch 1 (micro-batch 1 x 8"
        " accumulated with activation checkpointing: ddp "
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"seq_len": 32},
            "`seq_len` needs `batch_size` (samples per rank and forward): the step peak is traced on a"
            " batch; got batch_size=None.",
        ),
        ({"activation_checkpointing": "auto"}, "`activation_checkpointing` needs `batch_size`"),
        (
            {"batch_size": 2},
            "`batch_size` needs one of `seq_len` (a (tokens, targets) batch of int64 tensors) or `sample_batch`",
        ),
        ({"batch_size": 0, "seq_len": 4}, "`batch_size` must be a positive int; got 0."),
        (
            {"batch_size": 2, "sample_batch": "nomodule"},
            "`sample_batch` must be given as 'MODULE:function' or a callable; got 'nomodule'.",
        ),
    ],
)
def test_batch_option_errors_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        estimate(GPT, init_args=GPT_ARGS, world_sizes=[2], **kwargs)


def test_a_training_step_that_does_not_return_a_loss_is_named():
    class NoLoss(TinyLM):
        def training_step(self, batch, batch_idx):
            self.loss(batch)

    with pytest.raises(ValueError, match=re.escape("NoLoss.training_step must return the loss")):
        estimate(NoLoss, world_sizes=[2], batch_size=2, seq_len=SEQ)


def test_a_sample_batch_factory_replaces_the_token_batch():
    factory = lambda n: (torch.zeros(n, SEQ, dtype=torch.long), torch.zeros(n, SEQ, dtype=torch.long))  # noqa: E731
    by_factory = estimate(TinyLM, world_sizes=[2], strategies=["fsdp2"], batch_size=3, sample_batch=factory).rows[0]
    by_length = estimate(TinyLM, world_sizes=[2], strategies=["fsdp2"], batch_size=3, seq_len=SEQ).rows[0]
    assert by_factory.step_peak_bytes == by_length.step_peak_bytes


def test_command_with_a_batch_prints_activations_and_a_setting(capsys):
    argv = [
        "estimate",
        "fsdp_strategy.tools.benchmark.gpt:GPT",
        "--init-args",
        '{"n_layer": 2, "n_head": 2, "n_embd": 64}',
        "--world-sizes",
        "2",
        "--strategies",
        "ddp,fsdp2",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--activation-checkpointing",
        "Block",
        "--budget",
        "1GiB",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "* peak: the live tensors at the worst moment of a training step of 4 samples per rank" in out
    assert "  checkpointed: the same with activation checkpointing of ['Block']." in out
    assert "world size 2: ddp (ddp at micro-batch 4 needs " in out
