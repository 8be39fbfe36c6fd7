"""Step time and communication of Muon and Adafactor under ``fsdp2`` against ``ddp`` and against AdamW.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/optimizer_step.py --rounds 3

The benchmark's GPT (``benchmarks/_model.py``; fp32) trained with, in manual optimization so that all three run the
same loop: ``adamw`` (``torch.optim.AdamW`` over every parameter), ``muon`` (``torch.optim.Muon`` over the blocks'
matrices, AdamW over the rest: embeddings, head, norms, biases) and ``adafactor`` (``torch.optim.Adafactor`` over
every parameter), each under ``fsdp2`` and ``ddp``. The six fits run in rounds, interleaved (this machine is shared
and noisy), each fit ``--warmup`` + ``--steps`` optimizer steps; per configuration the median, min and max over all
timed steps of all rounds of the whole step's wall time and of the optimizer steps' wall time (from the first
optimizer's ``step`` to the last one's return). Bytes per step and rank are those of the collectives rank 0 issued in
one timed step (``testkit.collectives``; an all-gather counts its output, a reduce-scatter and an all-to-all their
input, an all-reduce its tensor), floating-point tensors only. Results go to ``benchmarks/results/optimizer_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # testkit/, beside the package

import lightning as L
import torch
import torch.distributed as dist
from _model import build_model

from fsdp_strategy.tools.benchmark.gpt import GPT
from fsdp_strategy.tools.benchmark.worker import next_token_loss, token_loader
from testkit.collectives import CountCollectives, bytes_by_kind

OPTIMIZERS = ("adamw", "muon", "adafactor")
STRATEGIES = ("fsdp2", "ddp")
RESULTS = Path(__file__).resolve().parent / "results" / "optimizer_step.json"


class ManualGPT(GPT):
    def __init__(self, optimizer: str, **sizes: int) -> None:
        super().__init__(**sizes)
        self.optimizer_name = optimizer
        self.automatic_optimization = False
        self.optimizer_seconds: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(next_token_loss(self, batch))
        start = time.perf_counter()
        for optimizer in optimizers:
            optimizer.step()
        self.optimizer_seconds.append(time.perf_counter() - start)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        if self.optimizer_name == "adafactor":
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)
        named = list(self.named_parameters())
        matrices = [p for name, p in named if p.ndim == 2 and ".blocks." in f".{name}"]
        rest = [p for name, p in named if not (p.ndim == 2 and ".blocks." in f".{name}")]
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.seconds.append(time.perf_counter() - self.start)


def fit(strategy: str, optimizer: str, args: argparse.Namespace, rank: int, world: int) -> dict:
    L.seed_everything(0, verbose=False)
    sizes = {"vocab_size": args.vocab_size, "block_size": args.seq_len, "n_layer": args.n_layer}
    model = build_model(**sizes, n_head=args.n_head, n_embd=args.n_embd, cls=_bound(optimizer))
    collectives, times = CountCollectives(), StepTimes()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        # Batches, not optimizer steps: manual optimization counts each optimizer's step (Muon's two).
        max_epochs=1,
        limit_train_batches=args.warmup + args.steps,
        use_distributed_sampler=False,  # token_loader splits the batches over the ranks itself
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[collectives, times],
    )
    trainer.fit(model, token_loader(args, rank, world))
    batch = [r for r in collectives.records if r.step == _steps_before(args.warmup, optimizer) and r.floating]
    return {
        "step_s": times.seconds[args.warmup :],
        "optimizer_s": model.optimizer_seconds[args.warmup :],
        "bytes": bytes_by_kind(batch),
    }


def _steps_before(batch: int, optimizer: str) -> int:
    """``trainer.global_step`` at the start of batch ``batch``: each optimizer's step counts."""
    return batch * (2 if optimizer == "muon" else 1)


def _bound(optimizer: str) -> type:
    return type("ManualGPT", (ManualGPT,), {"__init__": lambda self, **kw: ManualGPT.__init__(self, optimizer, **kw)})


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--optimizers", default=",".join(OPTIMIZERS), help="comma-separated, of " + ", ".join(OPTIMIZERS)
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    runs: dict[str, dict] = {}
    for _ in range(args.rounds):
        for optimizer in args.optimizers.split(","):
            for strategy in STRATEGIES:
                result = fit(strategy, optimizer, args, rank, world)
                run = runs.setdefault(f"{strategy}/{optimizer}", {"step_s": [], "optimizer_s": []})
                run["step_s"] += result["step_s"]
                run["optimizer_s"] += result["optimizer_s"]
                run["bytes"] = result["bytes"]
    if rank == 0:
        table = {
            run: {"step_s": summary(r["step_s"]), "optimizer_s": summary(r["optimizer_s"]), "bytes": r["bytes"]}
            for run, r in runs.items()
        }
        RESULTS.parent.mkdir(exist_ok=True)
        out = RESULTS.with_name(f"optimizer_step_{world}.json")
        out.write_text(json.dumps({"world_size": world, "args": vars(args), "runs": table}, indent=1))
        print(f"{'run':18} {'step s (min-max)':>26} {'optimizer s (min-max)':>26}  bytes per step and rank")
        for run, r in table.items():
            s, o = r["step_s"], r["optimizer_s"]
            print(
                f"{run:18} {s['median']:8.3f} ({s['min']:.3f}-{s['max']:.3f}) {o['median']:8.4f} ({o['min']:.4f}-"
                f"{o['max']:.4f})  " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(r["bytes"].items()))
            )
    dist.barrier()


if __name__ == "__main__":
    main()
