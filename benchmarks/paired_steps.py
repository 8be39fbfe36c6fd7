"""Step-level paired comparison: every Lightning training step is paired with one raw FSDP2 step.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/paired_steps.py --strategy fsdp2

``fsdp-strategy benchmark`` compares separate launches, which a shared machine's changing load can move by tens
of percent. Here one process pair runs both sides, interleaved step by step, so a load change hits both sides of
a pair:

* the Lightning side: ``Trainer(strategy=...).fit(model)`` (``fsdp2``, or ``model_parallel`` with the
  hand-written ``configure_model`` of ``fsdp_strategy/tools/benchmark/worker.py``);
* the raw side: a second copy of the model (same initial weights, same data, same AdamW), sharded by hand like the
  benchmark's ``raw_fsdp2`` (each block, then the model) and trained by a plain loop, one step of which runs
  inside a Callback during every Lightning step: at ``on_train_batch_start`` on even steps, at
  ``on_train_batch_end`` on odd steps (so neither side always runs first).

A Lightning step's time is the distance between two consecutive ``on_train_batch_start`` minus the raw step that
ran in between; the raw step's time covers fetching its batch, forward, loss, backward, ``step`` and
``zero_grad``. Per-step ratios Lightning/raw are reported as median (and the median difference in ms), for wall
time and for the CPU time rank 0's process used (``time.process_time()``, all threads). Prints one JSON line;
``--out`` appends it to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from fsdp_strategy.tools.benchmark.gpt import GPT
from fsdp_strategy.tools.benchmark.worker import (
    benchmark_class,
    make_optimizer,
    next_token_loss,
    shard_by_hand,
    token_loader,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=("fsdp2", "model_parallel"), default="fsdp2")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import fsdp_strategy  # noqa: F401

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n_steps = args.warmup + args.steps + 1
    kwargs = dict(
        vocab_size=args.vocab_size,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )

    class PairedRawStep(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.cpu_starts: list[float] = []
            self.raw: list[float] = []
            self.raw_cpu: list[float] = []
            self.raw_losses: list[float] = []
            self.lightning_losses: list[float] = []

        def setup(self, trainer, pl_module, stage):  # the process group exists from here on
            torch.manual_seed(0)
            self.model = GPT(**kwargs)
            shard_by_hand(self.model, init_device_mesh("cpu", (world,)), MixedPrecisionPolicy())
            self.optimizer = make_optimizer(self.model)
            self.batches = iter(token_loader(args, rank, world))
            self.model.train()

        def raw_step(self) -> None:
            t0, c0 = time.perf_counter(), time.process_time()
            x, y = next(self.batches)
            loss = next_token_loss(self.model, (x, y))
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.raw.append(time.perf_counter() - t0)
            self.raw_cpu.append(time.process_time() - c0)
            self.raw_losses.append(loss.item())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())
            self.cpu_starts.append(time.process_time())
            if batch_idx % 2 == 0 and batch_idx < n_steps - 1:
                self.raw_step()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.lightning_losses.append(float(outputs["loss"]))
            if batch_idx % 2 == 1:
                self.raw_step()

    strategy = args.strategy
    if strategy == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    torch.manual_seed(0)
    model = benchmark_class(GPT, args.strategy)(**kwargs)
    paired = PairedRawStep()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        max_steps=n_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[paired],
    )
    trainer.fit(model, train_dataloaders=token_loader(args, rank, world))

    timed = range(args.warmup, args.warmup + args.steps)
    lightning = [paired.starts[i + 1] - paired.starts[i] - paired.raw[i] for i in timed]
    raw = [paired.raw[i] for i in timed]
    ratios = [a / b for a, b in zip(lightning, raw)]
    lightning_cpu = [paired.cpu_starts[i + 1] - paired.cpu_starts[i] - paired.raw_cpu[i] for i in timed]
    raw_cpu = [paired.raw_cpu[i] for i in timed]
    cpu_ratios = [a / b for a, b in zip(lightning_cpu, raw_cpu)]
    if rank == 0:
        record = {
            "strategy": args.strategy,
            "model_source": "fsdp_strategy.tools.benchmark.gpt:GPT",
            "median_lightning_ms": 1e3 * statistics.median(lightning),
            "median_raw_ms": 1e3 * statistics.median(raw),
            "median_step_ratio": statistics.median(ratios),
            "ratio_of_medians": statistics.median(lightning) / statistics.median(raw),
            "median_delta_ms": 1e3 * statistics.median([a - b for a, b in zip(lightning, raw)]),
            "p25_step_ratio": statistics.quantiles(ratios, n=4)[0],
            "p75_step_ratio": statistics.quantiles(ratios, n=4)[2],
            "median_lightning_cpu_ms": 1e3 * statistics.median(lightning_cpu),
            "median_raw_cpu_ms": 1e3 * statistics.median(raw_cpu),
            "median_step_ratio_cpu": statistics.median(cpu_ratios),
            "median_delta_cpu_ms": 1e3 * statistics.median([a - b for a, b in zip(lightning_cpu, raw_cpu)]),
            "p25_step_ratio_cpu": statistics.quantiles(cpu_ratios, n=4)[0],
            "p75_step_ratio_cpu": statistics.quantiles(cpu_ratios, n=4)[2],
            "same_losses": paired.raw_losses[: n_steps - 1] == paired.lightning_losses[: n_steps - 1],
            "lightning_ms": [1e3 * t for t in lightning],
            "raw_ms": [1e3 * t for t in raw],
            "lightning_cpu_ms": [1e3 * t for t in lightning_cpu],
            "raw_cpu_ms": [1e3 * t for t in raw_cpu],
            "config": vars(args),
        }
        line = json.dumps(record)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "a") as f:
                f.write(line + "\n")
        print(
            "[paired_steps] "
            + json.dumps({k: v for k, v in record.items() if not k.endswith("_ms") or k.startswith("median")}),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
