"""Step time and memory per rank of tensor parallelism inside FSDP2 (2 data x 2 tensor) against 1-D ``fsdp2``
(4 data) on 4 CPU ranks (gloo), for docs/benchmarks.md.

Run: ``torchrun --standalone --nproc-per-node=4 benchmarks/tensor_parallel.py --layout 2x2`` (or ``4x1``). Both
layouts train the same GPT on the same global batches; the first 3 steps are warm-up. Rank 0 prints one Markdown
row: the median step time, the largest peak RSS of a rank, and the model state (parameters) each rank holds.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import fsdp_strategy
from testkit.tensor_parallel import GPT, TensorParallelGPT

WIDTH, HEADS, LAYERS, VOCAB, SEQ, GLOBAL_BATCH, STEPS, WARMUP = 512, 8, 4, 4096, 128, 16, 13, 3


class BenchGPT(TensorParallelGPT):
    def __init__(self, parallelize: str) -> None:
        super().__init__(parallelize, lr=1e-4)
        self.model = GPT(width=WIDTH, heads=HEADS, layers=LAYERS, vocab=VOCAB)


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.start = 0.0
        self.local_elements = 0  # of the parameters this rank holds while it trains

    def on_train_batch_start(self, *args: object) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        self.times.append(time.perf_counter() - self.start)
        self.local_elements = sum(p.to_local().numel() for p in module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["2x2", "4x1"], required=True)
    args = parser.parse_args()
    tensor = 2 if args.layout == "2x2" else 1
    L.seed_everything(0)
    model = BenchGPT("tp_fsdp" if tensor == 2 else "none")
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=GLOBAL_BATCH // (4 // tensor))
    times = StepTimes()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=fsdp_strategy.FSDP2Strategy(tensor_parallel_size=tensor),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[times],
    )
    trainer.fit(model, loader)
    measured = torch.tensor(
        [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, times.local_elements * 4 / 2**20]
    )
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        step = statistics.median(times.times[WARMUP:])
        total = sum(p.numel() for p in model.parameters())
        print(
            f"| {args.layout} | {total / 1e6:.1f}M | {step * 1000:.0f} ms | {measured[0]:.0f} MiB |"
            f" {measured[1]:.1f} MiB |"
        )


if __name__ == "__main__":
    main()
