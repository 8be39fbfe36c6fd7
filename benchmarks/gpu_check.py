"""The GPU checks of ``benchmarks/gpu_check.sh``, one part per torchrun job.

Parts (``--part``):

* ``parity``: the same GPT trained under ``ddp``, ``fsdp2`` and ``fsdp2_offload`` (CUDA only) at ``32-true``,
  and under ``ddp``, ``fsdp2`` at ``bf16-mixed`` and ``32-true`` reference: final parameters compared
  (``fsdp2`` and offload against ``ddp`` in fp32; at bf16 each one's distance to the fp32 run, ``fsdp2``'s at
  most 2x ``ddp``'s, the bound of ``integration_tests``' CPU bf16 test).
* ``speed``: step time, tokens/s and model FLOPs utilization of a ~1B-parameter GPT at ``bf16-mixed`` under
  ``fsdp2`` (eager, no compile).
* ``memory``: ``torch.cuda.max_memory_allocated`` per rank of the 116M GPT (fp32, AdamW) under ``ddp`` and
  ``fsdp2``, as ``fsdp-strategy benchmark --size large`` measures host memory on CPU.

Every part writes ``OUT/<part>.json`` on rank 0 and prints its table. ``--device cpu --tiny`` runs the same
code on CPU (gloo) with tiny shapes, so the script is exercised without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fsdp_strategy  # noqa: F401  (registers the strategy names)
from fsdp_strategy.tools.benchmark.gpt import GPT, GPT_SIZES

SEED = 0


class BenchGPT(GPT):
    """The example GPT with the benchmark's loss (nothing logged) and plain AdamW."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def loader(batches: int, batch_size: int, seq_len: int, vocab: int, world_size: int, rank: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (batches * batch_size * world_size, seq_len + 1), generator=generator)
    dataset = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


class StepClock(L.Callback):
    """Wall time at each batch start, after the device finished the previous step's work."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())


def trainer(args: argparse.Namespace, strategy: str, precision: str, steps: int, callbacks=()) -> L.Trainer:  # type: ignore[no-untyped-def]
    return L.Trainer(
        accelerator=args.device, devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
        precision=precision, max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=list(callbacks), default_root_dir=args.out,
    )  # fmt: skip


def train(
    args: argparse.Namespace,
    shape: dict,
    strategy: str,
    precision: str,
    steps: int,
    batch_size: int,
    seq_len: int,
    callbacks=(),
) -> GPT:  # type: ignore[no-untyped-def]
    """Trains a fresh GPT; returns the module (after fit a plain module again, holding the trained values)."""
    torch.manual_seed(SEED)
    run = trainer(args, strategy, precision, steps, callbacks)
    model = BenchGPT(**shape, block_size=seq_len, vocab_size=args.vocab)
    run.fit(model, loader(steps, batch_size, seq_len, args.vocab, run.world_size, run.global_rank))
    return model


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().cpu().flatten() for p in model.parameters()])


def part_parity(args: argparse.Namespace) -> dict:
    shape = GPT_SIZES["tiny" if args.tiny else "small"]
    common = {"steps": 5, "batch_size": 4, "seq_len": 64 if args.tiny else 256}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 really fp32
    runs = {
        ("ddp", "32-true"): None,
        ("fsdp2", "32-true"): None,
        ("ddp", "bf16-mixed"): None,
        ("fsdp2", "bf16-mixed"): None,
    }
    if args.device == "cuda":
        runs[("fsdp2_offload", "32-true")] = None
        # fp16 with the sharded gradient scaler (its overflow check agreed over NCCL); on a CPU accelerator
        # Lightning turns 16-mixed into bf16-mixed, so only a GPU runs this path.
        runs[("ddp", "16-mixed")] = runs[("fsdp2", "16-mixed")] = None
    for strategy, precision in runs:
        runs[(strategy, precision)] = flat(train(args, shape, strategy, precision, **common))
    reference = runs[("ddp", "32-true")]

    def distance(key) -> float:  # type: ignore[no-untyped-def]
        return float((runs[key] - reference).abs().max())

    result = {
        "fsdp2_vs_ddp_fp32_max_abs": distance(("fsdp2", "32-true")),
        "bf16_error_ddp": distance(("ddp", "bf16-mixed")),
        "bf16_error_fsdp2": distance(("fsdp2", "bf16-mixed")),
    }
    result["bf16_error_ratio"] = result["bf16_error_fsdp2"] / result["bf16_error_ddp"]
    if ("fsdp2", "16-mixed") in runs:
        result["fp16_error_ddp"] = distance(("ddp", "16-mixed"))
        result["fp16_error_fsdp2"] = distance(("fsdp2", "16-mixed"))
        result["fp16_error_ratio"] = result["fp16_error_fsdp2"] / result["fp16_error_ddp"]
    if ("fsdp2_offload", "32-true") in runs:
        result["offload_vs_fsdp2_fp32_max_abs"] = float(
            (runs[("fsdp2_offload", "32-true")] - runs[("fsdp2", "32-true")]).abs().max()
        )
    # Different reduction orders (all-reduce against reduce-scatter) differ in the last bits; AdamW's first
    # steps turn that into ~1e-6 relative. The CPU integration tests hold 1e-5.
    result["passed"] = (
        result["fsdp2_vs_ddp_fp32_max_abs"] <= 1e-4
        and result["bf16_error_ratio"] <= 2.0
        and result.get("fp16_error_ratio", 0.0) <= 2.0
        and result.get("offload_vs_fsdp2_fp32_max_abs", 0.0) <= 1e-5
    )
    return result


def gpt_flops_per_token(params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward matmuls) and causal attention's
    scores and weighted sum, 6 * n_layer * n_embd * seq_len (half of 12, for the causal mask)."""
    return 6 * params + 6 * n_layer * n_embd * seq_len


def peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    from fsdp_strategy.monitor.flops import (
        peak_flops_per_device,  # the datasheet table ShardingMonitor uses
    )

    return peak_flops_per_device(torch.device("cuda", 0), "bf16-mixed", None)


def part_speed(args: argparse.Namespace) -> dict:
    # ~1.0B parameters: 12 * n_layer * n_embd^2 = 1.01e9 for 20 layers of 2048, plus the byte embedding.
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 64} if args.tiny else {"n_layer": 20, "n_head": 16, "n_embd": 2048}
    seq_len, batch_size = (64, 2) if args.tiny else (2048, args.batch_size)
    warmup, timed = (2, 3) if args.tiny else (3, 10)
    clock = StepClock()
    torch.manual_seed(SEED)
    run = trainer(args, "fsdp2", "bf16-mixed", warmup + timed + 1, [clock])
    with run.init_module(empty_init=True):  # each rank initializes its shards only
        model = BenchGPT(**shape, block_size=seq_len, vocab_size=args.vocab)
    params = sum(p.numel() for p in model.parameters())
    run.fit(model, loader(warmup + timed + 1, batch_size, seq_len, args.vocab, run.world_size, run.global_rank))
    steps = [b - a for a, b in zip(clock.starts[warmup:], clock.starts[warmup + 1 :])]
    step = statistics.median(steps)
    tokens_per_s = batch_size * seq_len * run.world_size / step
    flops_per_s = gpt_flops_per_token(params, shape["n_layer"], shape["n_embd"], seq_len) * tokens_per_s
    peak = peak_flops(args.device)
    return {
        "params": params,
        **shape,
        "seq_len": seq_len,
        "batch_size_per_rank": batch_size,
        "world_size": run.world_size,
        "step_s_median": step,
        "step_s_min": min(steps),
        "step_s_max": max(steps),
        "tokens_per_s": tokens_per_s,
        "tflops_per_s_per_device": flops_per_s / run.world_size / 1e12,
        "mfu": None if peak is None else flops_per_s / run.world_size / peak,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
    }


def part_memory(args: argparse.Namespace) -> dict:
    shape = GPT_SIZES["tiny" if args.tiny else "large"]
    rows = {}
    for strategy in ("ddp", "fsdp2"):
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        train(args, shape, strategy, "32-true", steps=3, batch_size=1, seq_len=64)
        peak = torch.cuda.max_memory_allocated() - before if args.device == "cuda" else None
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, peak)
        rows[strategy] = gathered
    if args.device == "cuda":
        rows["fsdp2_over_ddp"] = max(rows["fsdp2"]) / max(rows["ddp"])
    return rows


def part_lifecycle(args: argparse.Namespace) -> dict:
    """Device memory left after each of four fits in one process (``del`` of the module, ``gc.collect()``), the third
    failing in its second step: nothing of a finished run may stay on the device (flat after the first fit)."""
    import gc

    class Failing(BenchGPT):
        def training_step(self, batch, batch_idx: int):  # type: ignore[no-untyped-def]
            if batch_idx == 1:
                raise RuntimeError("a bad trial")
            return super().training_step(batch, batch_idx)

    shape = GPT_SIZES["tiny" if args.tiny else "small"]
    allocated, failed = [], []
    for fit in range(4):
        torch.manual_seed(SEED)
        run = trainer(args, "fsdp2", "bf16-mixed", 3)
        model = (Failing if fit == 2 else BenchGPT)(**shape, block_size=64, vocab_size=args.vocab)
        try:
            run.fit(model, loader(3, 2, 64, args.vocab, run.world_size, run.global_rank))
            failed.append(False)
        except RuntimeError:
            failed.append(True)
        del run, model
        gc.collect()
        allocated.append(torch.cuda.memory_allocated() if args.device == "cuda" else None)
    flat_after_first = args.device != "cuda" or all(a == allocated[0] for a in allocated)
    return {
        "allocated_after_each_fit": allocated,
        "fit_failed": failed,
        "passed": flat_after_first and failed == [False, False, True, False],
    }


PARTS = {"parity": part_parity, "speed": part_speed, "memory": part_memory, "lifecycle": part_lifecycle}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=PARTS, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run of the script on CPU)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step of the speed part")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--out", default="gpu_check_results")
    args = p.parse_args()
    result = PARTS[args.part](args)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.part}.json").write_text(json.dumps(result, indent=1))
        print(f"[gpu_check] {args.part}: {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
