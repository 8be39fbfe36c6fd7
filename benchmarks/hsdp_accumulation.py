"""Communication and memory of gradient accumulation under hybrid sharding, per optimizer step and rank.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        benchmarks/hsdp_accumulation.py --accumulate 4

4 gloo ranks, mesh ``(dp_replicate=2, dp_shard=2)``, the benchmark's GPT (``benchmarks/_model.py``, fp32, AdamW),
``accumulate_grad_batches=4``, three fits in the same processes, same weights and batches:

* ``default``: non-final micro-batches run no collective; full-size gradients accumulate unsharded and are
  reduce-scattered and all-reduced once per step;
* ``sync_each_all_reduce``: ``sync_grads_each_micro_batch=True`` as it ran before: a reduce-scatter *and* an
  all-reduce across replicas on every micro-batch (reproduced by a callback that turns FSDP2's all-reduce back on,
  ``set_requires_all_reduce(True)``, before each backward);
* ``sync_each``: ``sync_grads_each_micro_batch=True`` now: a reduce-scatter on every micro-batch, the all-reduce of
  the summed shards once per step.

Bytes are those of the collectives actually issued (``testkit.collectives``: a dispatch mode that sees every
``c10d`` op), on floating-point tensors, in the estimator's convention (an all-gather its gathered output, a
reduce-scatter its unsharded input, an all-reduce its tensor), for rank 0 in one optimizer step after the first;
the estimate is ``fsdp_strategy.estimator.model_state.estimate_module`` of the same model and options. Memory is
bytes in use in the C heap (glibc's ``mallinfo2``, ``testkit.allocator_peak``), the largest over the ranks: held
between micro-batches (after each non-final micro-batch of step 1, above the start of its window, when the
gradients are ``None``), and the fit's peak above its first batch (optimizer state created at the first step
included, which the accumulation does not change). Results go to ``benchmarks/results/hsdp_accumulation.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # testkit/, beside the package

import lightning as L
import torch
import torch.distributed as dist
from _model import build_model
from torch.distributed.fsdp import FSDPModule

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.estimator.model_state import estimate_module
from fsdp_strategy.tools.benchmark.worker import token_loader
from testkit.allocator_peak import AllocatorPeak, host_in_use
from testkit.collectives import CountCollectives, bytes_by_kind, counts_by_kind

SETTINGS = ("default", "sync_each_all_reduce", "sync_each")
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
RESULTS = Path(__file__).resolve().parent / "results" / "hsdp_accumulation.json"


class AllReduceEveryMicroBatch(L.Callback):
    """The behaviour of ``sync_grads_each_micro_batch=True`` before the all-reduce was deferred."""

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if isinstance(pl_module, FSDPModule):
            pl_module.set_requires_all_reduce(True)


class WindowMemory(L.Callback):
    """Bytes in use after each non-final micro-batch of the window of optimizer step ``step``, above what was in
    use when the window began (gradients are ``None`` then): what accumulating holds between micro-batches."""

    def __init__(self, accumulate: int, step: int = 1) -> None:
        self.accumulate, self.step = accumulate, step
        self.start: int | None = None
        self.held_bytes = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step and batch_idx % self.accumulate == 0:
            # Lightning sets the last step's gradients to None in this micro-batch, before its backward; done here,
            # before the forward, the start counts none and the run is the same.
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)
            self.start = host_in_use()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        final = batch_idx % self.accumulate == self.accumulate - 1
        if self.start is not None and trainer.global_step == self.step and not final:
            self.held_bytes = max(self.held_bytes, host_in_use() - self.start)


def gpt(args: argparse.Namespace) -> L.LightningModule:
    sizes = {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd}
    return build_model(vocab_size=args.vocab_size, block_size=args.seq_len, **sizes)


def fit(setting: str, args: argparse.Namespace, rank: int, world: int) -> dict:
    L.seed_everything(0, verbose=False)
    model = build_model(
        vocab_size=args.vocab_size,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    collectives, memory, window = CountCollectives(), AllocatorPeak(args.steps), WindowMemory(args.accumulate)
    callbacks: list[L.Callback] = [collectives, memory, window]
    if setting == "sync_each_all_reduce":
        callbacks.append(AllReduceEveryMicroBatch())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=FSDP2Strategy(replicate_size=2, sync_grads_each_micro_batch=setting != "default"),
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        use_distributed_sampler=False,  # token_loader splits the batches over the ranks itself
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    loader_args = argparse.Namespace(**vars(args), warmup=0)
    loader_args.steps = args.steps * args.accumulate
    trainer.fit(model, token_loader(loader_args, rank, world))
    step = [r for r in collectives.records if r.step == 1 and r.floating]
    memory_bytes = torch.tensor([window.held_bytes, memory.peak_bytes - (memory.start_bytes or 0)])
    dist.all_reduce(memory_bytes, op=dist.ReduceOp.MAX)
    held, peak = memory_bytes.tolist()
    return {"bytes": bytes_by_kind(step), "counts": counts_by_kind(step), "held_bytes": held, "peak_bytes": peak}


def estimate(setting: str, args: argparse.Namespace, world: int) -> dict:
    with torch.device("meta"):
        model = gpt(args)
    row = estimate_module(
        model,
        strategy="fsdp2_hybrid",
        world_size=world,
        processes_per_node=world // 2,
        accumulate_grad_batches=args.accumulate,
        sync_grads_each_micro_batch=setting != "default",
    )
    return {
        "all_gather": row.all_gather_bytes,
        "reduce_scatter": row.reduce_scatter_bytes,
        "all_reduce": row.all_reduce_bytes,
    }


def markdown(results: dict) -> str:
    mib = 2**20
    lines = [
        "| setting | all-gather MiB | reduce-scatter MiB (count) | all-reduce MiB (count) | estimate RS / AR MiB |"
        " held between micro-batches, MiB | fit's peak above its start, MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for setting, row in results.items():
        measured, counts, est = row["measured"]["bytes"], row["measured"]["counts"], row["estimate"]
        if setting == "sync_each_all_reduce":
            # the estimator models the strategy as it runs now; the old behaviour all-reduced every micro-batch
            est = {**est, "all_reduce": None}
        lines.append(
            f"| {setting} | {measured.get('all_gather', 0) / mib:.2f}"
            f" | {measured.get('reduce_scatter', 0) / mib:.2f} ({counts.get('reduce_scatter', 0)})"
            f" | {measured.get('all_reduce', 0) / mib:.2f} ({counts.get('all_reduce', 0)})"
            f" | {est['reduce_scatter'] / mib:.2f} / "
            + ("n/a" if est["all_reduce"] is None else f"{est['all_reduce'] / mib:.2f}")
            + f" | {row['measured']['held_bytes'] / mib:.1f} | {row['measured']['peak_bytes'] / mib:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per fit (step 1 is reported)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {
        setting: {"measured": fit(setting, args, rank, world), "estimate": estimate(setting, args, world)}
        for setting in SETTINGS
    }
    if rank == 0:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps({"args": vars(args), "world_size": world, "results": results}, indent=2))
        print(markdown(results))


if __name__ == "__main__":
    main()
