"""``ShardingMonitor``: option errors, reading batches, the estimator bridge, the summary, and in-process
fits on one rank (FSDP2 and a single device). The 2-rank comparison with DDP is in integration_tests/."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn

from fsdp_strategy import FSDP2Strategy, ShardingMonitor
from fsdp_strategy.estimator.model_state import estimate_module
from fsdp_strategy.monitor.batches import BatchCounter, batch_size_of, tokens_of
from fsdp_strategy.monitor.flops import datasheet_flops
from fsdp_strategy.monitor.plan_costs import communication_estimate, estimate_figures, optimizer_name, plan_of
from fsdp_strategy.monitor.summary import format_summary, summarize
from testkit.models import SEQ, VOCAB, WIDTH, TinyLM, token_loader


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"warmup_steps": 0}, ValueError, "`warmup_steps` must be a positive int; got 0."),
        ({"warmup_steps": 2.5}, TypeError, "`warmup_steps` must be a positive int; got 2.5 of type float."),
        ({"warmup_steps": True}, TypeError, "`warmup_steps` must be a positive int; got True of type bool."),
        (
            {"batch_size_fn": 8},
            TypeError,
            "`batch_size_fn` must be a callable batch -> int, or None; got 8 of type int.",
        ),
        (
            {"tokens_fn": "numel"},
            TypeError,
            "`tokens_fn` must be a callable batch -> int, or None; got 'numel' of type str.",
        ),
        ({"tokens_per_sample": 0}, ValueError, "`tokens_per_sample` must be a positive int or None; got 0."),
        (
            {"tokens_per_sample": "64"},
            TypeError,
            "`tokens_per_sample` must be a positive int or None; got '64' of type str.",
        ),
        (
            {"tokens_fn": len, "tokens_per_sample": 64},
            ValueError,
            "Pass `tokens_fn` or `tokens_per_sample`, not both; got tokens_fn=<built-in function len> and tokens_per_sample=64.",
        ),
        (
            {"peak_tflops": "312"},
            TypeError,
            "`peak_tflops` must be a positive number (the device's peak TFLOP/s) or None; got '312' of type str.",
        ),
        (
            {"peak_tflops": True},
            TypeError,
            "`peak_tflops` must be a positive number (the device's peak TFLOP/s) or None; got True of type bool.",
        ),
        (
            {"peak_tflops": 0.0},
            ValueError,
            "`peak_tflops` must be a positive number (the device's peak TFLOP/s) or None; got 0.0.",
        ),
        (
            {"peak_tflops": math.inf},
            ValueError,
            "`peak_tflops` must be a positive number (the device's peak TFLOP/s) or None; got inf.",
        ),
        ({"count_flops": "yes"}, TypeError, "`count_flops` must be a bool; got 'yes' of type str."),
        ({"print_summary": 1}, TypeError, "`print_summary` must be a bool; got 1 of type int."),
        (
            {"live_tensor_steps": -1},
            ValueError,
            "`live_tensor_steps` must be an int >= 0 (0: do not count live tensors); got -1.",
        ),
        (
            {"live_tensor_steps": 2.0},
            TypeError,
            "`live_tensor_steps` must be an int >= 0 (0: do not count live tensors); got 2.0 of type float.",
        ),
    ],
)
def test_bad_options_name_the_option_value_and_what_is_accepted(options, error, message):
    with pytest.raises(error, match=re.escape(message) + "$"):
        ShardingMonitor(**options)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        ShardingMonitor(3)  # type: ignore[misc]


def test_batch_size_and_tokens_are_read_from_the_batch():
    tokens, targets = torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)
    assert batch_size_of((tokens, targets)) == (4, False)
    assert tokens_of((tokens, targets)) == (32, False)
    hf_style = {"input_ids": tokens, "attention_mask": torch.ones(4, 8, dtype=torch.int64), "labels": targets}
    assert tokens_of(hf_style) == (32, False)
    images = [torch.zeros(4, 3, 2, 2), torch.zeros(4, dtype=torch.long)]
    assert batch_size_of(images) == (4, False)
    assert tokens_of(images) == (None, False)  # no token ids: tokens/s is simply not reported
    assert tokens_of([tokens, torch.zeros(4, 5, dtype=torch.long)]) == (None, True)
    assert batch_size_of([tokens, torch.zeros(2, 8)]) == (4, True)
    assert batch_size_of({"meta": "text"}) == (None, False)


def test_ambiguous_batches_warn_once_and_name_the_option():
    counter = BatchCounter()
    batch = [torch.zeros(4, 8, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)]
    with pytest.warns(UserWarning) as caught:
        counter.count(batch)
        counter.count(batch)
    messages = [str(w.message) for w in caught]
    assert messages == [
        "ShardingMonitor: the batch holds tensors of different lengths; counting 4 samples per batch."
        " Pass `batch_size_fn` to say how many.",
        "ShardingMonitor: the batch holds integer tensors of different sizes, so tokens/s is not reported."
        " Pass `tokens_fn` or `tokens_per_sample`.",
    ]
    assert counter.samples == 8 and counter.batches == 2 and not counter.tokens_known


def test_optimizer_and_strategy_names_for_the_estimator():
    params = [nn.Parameter(torch.zeros(2))]
    assert optimizer_name([torch.optim.AdamW(params)]) == "adamw"
    assert optimizer_name([torch.optim.Adam(params)]) == "adam"
    assert optimizer_name([torch.optim.SGD(params, lr=0.1)]) == "sgd"
    assert optimizer_name([torch.optim.SGD(params, lr=0.1, momentum=0.9)]) == "sgd_momentum"
    assert optimizer_name([torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1)]) is None
    assert optimizer_name([torch.optim.RMSprop(params)]) is None

    def two_ranks(strategy: FSDP2Strategy, ranks: int = 2) -> FSDP2Strategy:
        strategy.parallel_devices = [torch.device("cpu")] * ranks
        return strategy

    one_dimensional = {"processes_per_node": None, "tensor_parallel_size": 1, "sync_grads_each_micro_batch": False}
    assert plan_of(two_ranks(FSDP2Strategy())) == {"strategy": "fsdp2", **one_dimensional}
    assert plan_of(two_ranks(FSDP2Strategy(reshard_after_forward=False)))["strategy"] == "fsdp2_grad_op"
    assert plan_of(two_ranks(FSDP2Strategy(replicate_size=2))) == {
        "strategy": "fsdp2_hybrid",
        "processes_per_node": 1,
        "tensor_parallel_size": 1,
        "sync_grads_each_micro_batch": False,
    }
    assert plan_of(two_ranks(FSDP2Strategy(reshard_after_forward=2))) is None  # not a plan the estimator models
    assert plan_of(DDPStrategy()) == {"strategy": "ddp", **one_dimensional}
    # 4 ranks, 2 tensor-parallel: the data-parallel mesh is (1, 2), or (2, 1) replicated, each node 1 x 2 ranks
    assert plan_of(two_ranks(FSDP2Strategy(tensor_parallel_size=2), 4)) == {
        "strategy": "fsdp2",
        "processes_per_node": None,
        "tensor_parallel_size": 2,
        "sync_grads_each_micro_batch": False,
    }
    assert plan_of(two_ranks(FSDP2Strategy(tensor_parallel_size=2, replicate_size=2), 4)) == {
        "strategy": "fsdp2_hybrid",
        "processes_per_node": 2,
        "tensor_parallel_size": 2,
        "sync_grads_each_micro_batch": False,
    }
    synced = plan_of(two_ranks(FSDP2Strategy(replicate_size=2, sync_grads_each_micro_batch=True)))
    assert synced["strategy"] == "fsdp2_hybrid" and synced["sync_grads_each_micro_batch"] is True
    assert plan_of(SingleDeviceStrategy("cpu")) is None


def test_a_plan_the_estimator_does_not_model_is_named_in_the_note():
    strategy = FSDP2Strategy(reshard_after_forward=2)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    trainer = SimpleNamespace(strategy=strategy, optimizers=[])
    assert communication_estimate(trainer, nn.Linear(2, 2)) == (
        None,
        "the estimator has no plan for reshard_after_forward=2",
    )


def test_an_offloading_strategy_is_estimated_as_fsdp2_offload(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only the constructor asks
    strategy = FSDP2Strategy(cpu_offload=True)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    assert plan_of(strategy) == {
        "strategy": "fsdp2_offload",
        "processes_per_node": None,
        "tensor_parallel_size": 1,
        "sync_grads_each_micro_batch": False,
    }


def test_the_estimated_model_state_counts_offloaded_state_in_host_memory():
    with torch.device("meta"):
        model = TinyLM()
    offload = estimate_module(model, strategy="fsdp2_offload", world_size=2)
    sharded = estimate_module(model, strategy="fsdp2", world_size=2)
    assert offload.model_state_bytes == 0  # nothing on the device...
    # ...but the ranks hold the same shards as under fsdp2, in host memory, and measure them there.
    assert estimate_figures(offload)["estimated_model_state_bytes"] == sharded.model_state_bytes > 0
    assert estimate_figures(sharded)["estimated_model_state_bytes"] == sharded.model_state_bytes


def _row(**values: float) -> dict[str, float]:
    row = dict.fromkeys(
        (
            "peak_rss_bytes",
            "rss_growth_bytes",
            "live_peak_bytes",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "model_state_bytes",
            "samples",
            "tokens",
            "batches",
            "seconds",
            "flops_per_batch",
        ),
        math.nan,
    )
    return {**row, **values}


def test_summary_adds_ranks_together_over_the_slowest_rank():
    timed = {"samples": 80, "tokens": 640, "batches": 10, "flops_per_batch": 4e12}
    rows = [
        _row(peak_rss_bytes=3 * 2**30, model_state_bytes=2**30, seconds=2.0, **timed),
        _row(peak_rss_bytes=2 * 2**30, model_state_bytes=2**29, seconds=4.0, **timed),
    ]
    summary = summarize(rows, peak_flops=100e12)
    assert summary["samples_per_sec"] == 160 / 4.0
    assert summary["tokens_per_sec"] == 1280 / 4.0
    assert [r["tflops_per_sec"] for r in summary["ranks"]] == [20.0, 10.0]
    assert summary["tflops_per_sec"] == 15.0  # per device: the mean over ranks
    assert summary["mfu"] == pytest.approx(0.15)
    assert summary["max_peak_rss_bytes"] == 3 * 2**30
    assert summary["max_model_state_bytes"] == 2**30
    assert summary["ranks"][1]["peak_allocated_bytes"] is None  # NaN (not measured) becomes None

    table = format_summary(
        {
            **summary,
            "strategy": "fsdp2",
            "device": "cpu",
            "precision": "32-true",
            "steps": 13,
            "warmup_steps": 3,
            "all_gather_bytes": 3 * 2**20,
            "reduce_scatter_bytes": 2**20,
            "all_reduce_bytes": 0.0,
            "sent_bytes": 2**21,
            "estimated_model_state_bytes": 2**30,
        }
    )
    lines = table.splitlines()
    assert lines[0].startswith("ShardingMonitor: fsdp2 | 2 x cpu | 32-true | 13 steps")
    assert [cell.strip() for cell in lines[1].split("|")] == [
        "rank",
        "peak RSS",
        "RSS growth",
        "live peak",
        "model state",
        "samples/s",
        "tokens/s",
        "TFLOP/s",
    ]
    assert lines[3].split("|")[1].strip() == "3.0 GiB" and lines[4].split("|")[1].strip() == "2.0 GiB"
    assert "MFU 15.0% of 100.0 TFLOP/s peak" in table
    assert "all-gather 3.0 MiB, reduce-scatter 1.0 MiB, all-reduce 0 B" in table
    assert "measured 1.0 GiB (largest rank), estimated 1.0 GiB" in table


def test_summary_without_a_timed_window_or_a_peak_says_not_available():
    row = _row(peak_rss_bytes=2**30, samples=8, batches=1, seconds=math.nan, flops_per_batch=1e9)
    summary = summarize([row], peak_flops=None)
    assert summary["samples_per_sec"] is None and summary["tflops_per_sec"] is None and summary["mfu"] is None
    table = format_summary({**summary, "all_gather_bytes": None, "communication_note": "no sharding plan known for X"})
    assert "MFU n/a" in table and "communication per step: n/a (no sharding plan known for X)" in table


# --- in-process fits --------------------------------------------------------------------------------


def tiny_lm_adamw_state_bytes() -> int:
    """What one rank holds of TinyLM under fp32 AdamW after a step, from its architecture: parameters,
    gradients and AdamW's two moments, 4 bytes an element each, plus a 4-byte step counter per tensor."""
    block = [
        (WIDTH,),
        (WIDTH,),
        (WIDTH, WIDTH),
        (WIDTH,),
        (WIDTH, WIDTH),
        (2 * WIDTH, WIDTH),
        (2 * WIDTH,),
        (WIDTH, 2 * WIDTH),
        (WIDTH,),
    ]  # norm, attn_q, attn_k (no bias), mlp
    shapes = [(VOCAB, WIDTH), *block * 3, (WIDTH,), (WIDTH,), (WIDTH,)]  # embedding = head, blocks, norm, scale
    elements = sum(math.prod(shape) for shape in shapes)
    assert elements == sum(p.numel() for p in TinyLM().parameters())  # the architecture as counted here
    return 4 * 4 * elements + 4 * len(shapes)


def _fit(
    tmp_path: Path, monitor: ShardingMonitor, *, strategy="fsdp2", max_steps=6, **kwargs
) -> tuple[L.Trainer, TinyLM]:
    L.seed_everything(0)
    model = TinyLM()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path, name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
        **kwargs,
    )
    trainer.fit(model, token_loader(batch_size=4, samples=32))
    return trainer, model


def test_fsdp2_fit_summary_logs_and_flops_match_measure_flops(trainer_env, tmp_path, capsys):
    reference = TinyLM()  # an unsharded copy to count with Lightning's measure_flops
    batch = next(iter(token_loader(batch_size=4)))
    expected_flops = measure_flops(reference, lambda: reference.loss(batch), loss_fn=lambda loss: loss)

    monitor = ShardingMonitor(warmup_steps=2, peak_tflops=0.5)
    trainer, model = _fit(tmp_path, monitor, accumulate_grad_batches=2)

    summary = monitor.summary
    assert summary["flops_per_batch"] == expected_flops  # one micro-batch, forward and backward
    assert summary["strategy"] == "fsdp2" and summary["world_size"] == 1 and summary["steps"] == 6
    assert summary["measured_batches"] == (6 - 2) * 2  # micro-batches after the warm-up steps
    (rank,) = summary["ranks"]
    assert rank["samples_per_sec"] > 0 and rank["tokens_per_sec"] == pytest.approx(SEQ * rank["samples_per_sec"])
    assert summary["mfu"] == pytest.approx(summary["tflops_per_sec"] / 0.5)
    assert rank["peak_rss_bytes"] >= rank["rss_growth_bytes"] >= 0
    assert rank["model_state_bytes"] == tiny_lm_adamw_state_bytes()  # one rank holds everything, once
    # the live tensors of the first two steps: the model state and what the steps add to it
    assert rank["model_state_bytes"] < rank["live_peak_bytes"] < rank["model_state_bytes"] + 2**20
    # one rank: nothing to communicate; the estimate agrees with what is held
    assert summary["all_gather_bytes"] == summary["reduce_scatter_bytes"] == summary["all_reduce_bytes"] == 0
    assert summary["estimated_model_state_bytes"] == pytest.approx(rank["model_state_bytes"], rel=0.01)

    printed = capsys.readouterr().out
    assert "ShardingMonitor: fsdp2 | 1 x cpu | 32-true | 6 steps, throughput over 8 batches" in printed

    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("monitor/samples_per_sec")]
    assert [int(r["step"]) for r in logged] == [3, 5]  # steps 4 and 6: after the warm-up, every 2 steps
    assert all(float(r["monitor/peak_rss_mib"]) > 0 and float(r["monitor/mfu"]) > 0 for r in logged)
    assert all(float(r["monitor/live_peak_mib"]) * 2**20 == rank["live_peak_bytes"] for r in logged)
    assert any(r.get("monitor/model_state_mib") for r in rows)


def test_single_device_fit_with_counters_given_and_flops_off(trainer_env, tmp_path, capsys):
    monitor = ShardingMonitor(
        warmup_steps=1,
        batch_size_fn=lambda batch: 2 * len(batch[0]),
        tokens_per_sample=3,
        count_flops=False,
        print_summary=False,
        live_tensor_steps=0,
    )
    _fit(tmp_path, monitor, strategy="auto", max_steps=3)
    summary = monitor.summary
    assert summary["strategy"] == "single_device" and summary["flops_per_batch"] is None
    assert summary["ranks"][0]["live_peak_bytes"] is None  # not counted
    assert summary["max_model_state_bytes"] == tiny_lm_adamw_state_bytes()
    assert summary["tokens_per_sec"] == pytest.approx(3 * summary["samples_per_sec"])
    assert summary["all_gather_bytes"] is None
    assert summary["communication_note"] == "no sharding plan known for SingleDeviceStrategy"
    assert capsys.readouterr().out == ""


def test_a_batch_size_fn_returning_a_non_int_is_named(trainer_env, tmp_path):
    monitor = ShardingMonitor(batch_size_fn=lambda batch: 4.0)
    with pytest.raises(
        TypeError, match=re.escape("`batch_size_fn` must return an int; it returned 4.0 of type float.")
    ):
        _fit(tmp_path, monitor, strategy="auto", max_steps=1)


@pytest.mark.parametrize(
    ("device_name", "bf16_tflops", "fp32_tflops"),
    [
        ("NVIDIA H200", 989.5, 67.0),  # torch's name of an H200 SXM, which Lightning's table does not match
        ("NVIDIA H200 NVL", 835.0, 60.0),
        ("NVIDIA H100 80GB HBM3", 989.5, 67.0),
        ("NVIDIA H100 PCIe", 756.0, 51.0),
        ("NVIDIA B200", 2250.0, 75.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 19.5),
        ("NVIDIA L40S", 362.05, 91.6),
        ("AMD Instinct MI300X", 1307.4, 163.4),
    ],
)
def test_datacenter_gpus_have_a_datasheet_peak(device_name, bf16_tflops, fp32_tflops):
    assert datasheet_flops(device_name, torch.bfloat16) == bf16_tflops * 1e12
    assert datasheet_flops(device_name, torch.float16) == bf16_tflops * 1e12
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert datasheet_flops(device_name, torch.float32) == fp32_tflops * 1e12
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: the tensor-core peak
        assert datasheet_flops(device_name, torch.float32) > fp32_tflops * 1e12
    finally:
        torch.set_float32_matmul_precision(previous)


def test_an_unknown_gpu_has_no_datasheet_peak():
    assert datasheet_flops("NVIDIA GeForce GTX 1080", torch.bfloat16) is None
    assert datasheet_flops("NVIDIA H200", torch.float64) is None
