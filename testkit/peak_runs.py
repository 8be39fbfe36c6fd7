"""Measures the peak of live tensors of real training steps, for comparison with the estimator's prediction.

Run under torchrun (``python -m testkit.peak_runs --configs fsdp2/32-true/none,ddp/bf16-mixed/Block
--out peaks.json``): each rank trains the benchmark GPT for two optimizer steps per configuration, one
configuration after another in the same processes, with a :class:`~fsdp_strategy.ShardingMonitor` counting live
tensors, and rank 0 writes every rank's peak. A configuration is ``strategy/precision/activation checkpointing``
(a class name, or ``none``). Under ``ddp`` activation checkpointing is applied to the module before fit, as a DDP
user does it; the ``fsdp2`` variants get it as ``activation_checkpointing_policy``. Used by
``integration_tests/test_estimate_peak.py`` and ``benchmarks/estimate_peak.py``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDP2Strategy, ShardingMonitor
from fsdp_strategy.sharding.parallelize import apply_activation_checkpointing
from fsdp_strategy.sharding.policy import normalize_policy, select_modules
from fsdp_strategy.tools.benchmark.gpt import GPT

__all__ = ["STEPS", "live_peak_fit", "measure", "parse_config"]

STEPS = 2  # the second step is the steady one: the first step's gradients and optimizer state exist


def parse_config(text: str) -> tuple[str, str, list[str] | None]:
    """``"fsdp2/bf16-mixed/Block"`` as ``("fsdp2", "bf16-mixed", ["Block"])`` (``none``: no checkpointing)."""
    strategy, precision, checkpointing = text.split("/")
    return strategy, precision, None if checkpointing == "none" else checkpointing.split("+")


def _loader(batch_size: int, seq_len: int, vocab_size: int, micro_batches: int, world_size: int) -> DataLoader:
    # Lightning's distributed sampler gives each rank 1/world_size of the samples: every rank gets full batches.
    samples = batch_size * micro_batches * STEPS * world_size
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab_size, (samples, seq_len + 1), generator=generator)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)


def live_peak_fit(
    model: L.LightningModule,
    loader: DataLoader,
    *,
    strategy: str,
    precision: str = "32-true",
    checkpointing: list[str] | None = None,
    accumulate: int = 1,
) -> float:
    """This rank's peak bytes of live tensors over :data:`STEPS` optimizer steps of ``model`` under ``strategy``."""
    if strategy == "ddp" and checkpointing is not None:
        apply_activation_checkpointing(select_modules(model, normalize_policy(checkpointing, option="checkpointing")))
    monitor = ShardingMonitor(warmup_steps=1, count_flops=False, print_summary=False, live_tensor_steps=STEPS)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=strategy
        if strategy == "ddp"
        else FSDP2Strategy(
            reshard_after_forward=strategy != "fsdp2_grad_op", activation_checkpointing_policy=checkpointing
        ),
        precision=precision,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )
    trainer.fit(model, loader)
    return monitor.summary["ranks"][trainer.global_rank]["live_peak_bytes"]


def measure(config: str, model_args: dict, *, batch_size: int, seq_len: int, accumulate: int = 1) -> float:
    """This rank's peak bytes of live tensors over :data:`STEPS` optimizer steps of ``config`` on the GPT."""
    strategy, precision, checkpointing = parse_config(config)
    L.seed_everything(0)
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # torchrun sets it; the fits start the process group
    loader = _loader(batch_size, seq_len, model_args.get("vocab_size", 256), accumulate, world_size)
    return live_peak_fit(
        GPT(**model_args),
        loader,
        strategy=strategy,
        precision=precision,
        checkpointing=checkpointing,
        accumulate=accumulate,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", required=True, help="comma-separated strategy/precision/checkpointing")
    parser.add_argument("--model-args", default="{}", help="the GPT's constructor arguments, a JSON object")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model_args = json.loads(args.model_args)
    results = {}
    for config in args.configs.split(","):
        peak = measure(config, model_args, batch_size=args.batch_size, seq_len=args.seq_len, accumulate=args.accumulate)
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        results[config] = peaks
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()  # as torch asks of every process at the end of its work


if __name__ == "__main__":
    main()
