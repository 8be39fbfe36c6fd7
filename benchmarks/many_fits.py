"""Does host memory stay flat over many fits in one process (a sweep, a notebook)? Run it under torchrun:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/many_fits.py \
        --fits 20 --size large --strategy fsdp2

Each fit is a sweep trial: a fresh Trainer and a fresh example GPT (``--size``, AdamW) trained for ``--steps``
steps; the fit numbered ``--failing`` (1-based, 0 for none) raises in ``training_step`` at its second batch, as a
bad trial does. After each one: ``del trainer, model``, ``gc.collect()``, and ``malloc_trim(0)`` so that freed heap
pages do not count (fsdp_strategy/host_memory.py); then each rank's resident set size. Rank 0 prints one JSON line:
every rank's RSS after each fit, the growth from the second fit on (the largest RSS after a later fit minus the
RSS after the second), and that growth over one model's full training state (parameters, gradients and AdamW's two
states, fp32: 16 bytes per parameter). The goal (issue 20): at most 0.05, under ``fsdp2`` as under ``ddp``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from _model import BenchModel, build_model
from torch.utils.data import DataLoader, TensorDataset

import fsdp_strategy  # noqa: F401  (registers "fsdp2")
from fsdp_strategy import host_memory
from fsdp_strategy.tools.benchmark.gpt import GPT_SIZES


class FailingModel(BenchModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 1:
            raise RuntimeError("a bad trial")
        return super().training_step(batch, batch_idx)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def loader(steps: int, seq_len: int, vocab_size: int) -> DataLoader:
    # Lightning gives each rank its share of the samples: ``steps`` batches of one sequence per rank.
    samples = steps * dist.get_world_size() if dist.is_initialized() else steps * int(os.environ["WORLD_SIZE"])
    tokens = torch.randint(0, vocab_size, (samples, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)


def one_fit(args: argparse.Namespace, failing: bool) -> tuple[int, bool]:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=args.strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = build_model(
        vocab_size=args.vocab_size,
        block_size=args.seq_len,
        **GPT_SIZES[args.size],
        cls=FailingModel if failing else BenchModel,
    )
    params = sum(p.numel() for p in model.parameters())
    failed = False
    try:
        trainer.fit(model, loader(args.steps, args.seq_len, args.vocab_size))
    except RuntimeError:
        failed = True
    del trainer, model
    gc.collect()
    host_memory.release()
    return params, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fits", type=int, default=20)
    parser.add_argument("--failing", type=int, default=3, help="the fit (1-based) that fails; 0: none")
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--size", default="large", choices=sorted(GPT_SIZES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=256)
    args = parser.parse_args()
    rss, failed = [], []
    for fit in range(1, args.fits + 1):
        params, did_fail = one_fit(args, fit == args.failing)
        rss.append(rss_bytes())
        failed.append(did_fail)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, rss)
    if dist.get_rank() == 0:
        growth = max(max(r[1:]) - r[1] for r in per_rank)
        state = 16 * params
        print(
            json.dumps(
                {
                    "strategy": args.strategy,
                    "world_size": dist.get_world_size(),
                    "params": params,
                    "fits": args.fits,
                    "failed": [i + 1 for i, f in enumerate(failed) if f],
                    "rss_after_each_fit_mib": [[round(b / 2**20, 1) for b in r] for r in per_rank],
                    "growth_after_second_fit_mib": round(growth / 2**20, 1),
                    "model_state_mib": round(state / 2**20, 1),
                    "growth_over_model_state": round(growth / state, 4),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
