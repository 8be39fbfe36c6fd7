"""Per-step wall time of one FSDP2 training implementation, on 2 CPU ranks (gloo).

Run one implementation under torchrun (the driver ``benchmarks/run_step_time.py`` interleaves them):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/step_time.py --impl fsdp2 --out benchmarks/results/step_time_runs.jsonl

Implementations (same model, same initial weights, same data, same loss, same AdamW):

* ``raw``: a hand-written PyTorch loop: ``fully_shard`` on each transformer block, then on the model,
  then forward / ``loss.backward()`` / ``optimizer.step()`` / ``optimizer.zero_grad()``. No Lightning Trainer.
* ``fsdp2``: ``Trainer(strategy="fsdp2")`` (``fsdp_strategy.FSDP2Strategy``), the model unchanged.
* ``model_parallel``: ``Trainer(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))``
  with a hand-written ``configure_model`` that ``fully_shard``s each block and the root on
  ``self.device_mesh["data_parallel"]`` (and routes ``training_step`` through FSDP, which the root needs
  because Lightning calls ``training_step``, not ``forward``).
* ``raw_plan`` (diagnostic): the raw loop, but sharded into exactly the units ``FSDP2Strategy`` plans
  (``fsdp_strategy.parallelize.plan_units`` + ``apply_fully_shard``), to separate "which units" from
  "Lightning's loop".

Timing: rank 0 takes ``time.perf_counter()`` at the start of every training batch (right after the batch is
fetched: ``on_train_batch_start`` in Lightning, the top of the loop body in the raw loop). A step's time is the
distance between two consecutive starts, so it includes everything the loop does per step (data fetch, hooks,
forward, backward, optimizer step, zero_grad). FSDP's collectives keep the two ranks in lock step; on CPU there
is no asynchronous device work to synchronize. The first ``--warmup`` steps are not timed. The time from a
batch's start to its end (``on_train_batch_end``) is reported too, as ``inner``, and so is the CPU time rank 0's
process used per step (``time.process_time()`` between the same points, all threads), which a shared machine's
load disturbs much less than wall time.

The script appends one JSON line to ``--out`` (rank 0) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _model import MODEL_SOURCE, BenchModel, build_model, lm_loss, make_optimizer  # noqa: E402

IMPLS = ("raw", "fsdp2", "model_parallel", "raw_plan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, required=True)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (also the model's block_size)")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank and step")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--steps", type=int, default=60, help="timed steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-loss", action="store_true", help="Lightning impls: also self.log the loss every step")
    p.add_argument("--tag", default="", help="free text copied into the JSON line (e.g. the round number)")
    p.add_argument("--out", default=None, help="append the JSON line to this file (rank 0)")
    return p.parse_args(argv)


# --- data -------------------------------------------------------------------------------------------------------


def token_dataset(args: argparse.Namespace, world_size: int) -> TensorDataset:
    """Fixed random tokens: enough samples for every step on every rank, the same on every run."""
    samples = (args.warmup + args.steps + 1) * args.batch_size * world_size
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, args.vocab_size, (samples, args.seq_len + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def token_loader(args: argparse.Namespace, rank: int, world_size: int) -> DataLoader:
    """Rank ``rank``'s batches, in order. Passed as is to the Lightning Trainer too
    (``use_distributed_sampler=False``; Lightning's own injected sampler would shuffle)."""
    dataset = token_dataset(args, world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)


def total_steps(args: argparse.Namespace) -> int:
    # one more batch than timed, so the last timed step also has an "end" (the next step's start)
    return args.warmup + args.steps + 1


def model_kwargs(args: argparse.Namespace) -> dict:
    return dict(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                n_embd=args.n_embd)


# --- timing -----------------------------------------------------------------------------------------------------


class StepClock:
    """Wall time (``perf_counter``) and this process's CPU time (``process_time``, all its threads) at each
    batch start and end. On an oversubscribed machine the CPU time a step consumes moves much less with other
    jobs' load than its wall time does, so both are reported."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.cpu_starts: list[float] = []
        self.cpu_ends: list[float] = []
        self.losses: list[float] = []

    def start(self) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def end(self, loss: float) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        self.losses.append(loss)

    def summary(self, warmup: int, steps: int) -> dict:
        timed = range(warmup, warmup + steps)
        periods = [self.starts[i + 1] - self.starts[i] for i in timed]
        inner = [self.ends[i] - self.starts[i] for i in timed]
        cpu = [self.cpu_starts[i + 1] - self.cpu_starts[i] for i in timed]
        q = statistics.quantiles(periods, n=10)
        return {
            "median_s": statistics.median(periods),
            "mean_s": statistics.fmean(periods),
            "p10_s": q[0],
            "p90_s": q[-1],
            "min_s": min(periods),
            "median_inner_s": statistics.median(inner),
            "median_cpu_s": statistics.median(cpu),
            "step_times_s": periods,
            "step_cpu_s": cpu,
            "loss_first": self.losses[0],
            "loss_last_timed": self.losses[warmup + steps - 1],
        }


# --- raw PyTorch loop -------------------------------------------------------------------------------------------


def run_raw(args: argparse.Namespace, plan: str) -> tuple[StepClock, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    torch.manual_seed(args.seed)
    model = build_model(**model_kwargs(args))
    num_params = sum(p.numel() for p in model.parameters())
    if plan == "blocks+root":  # what a user writes by hand
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:  # exactly the units FSDP2Strategy shards
        from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

        from fsdp_strategy.parallelize import apply_fully_shard, plan_units

        units = plan_units(model, _auto_policy(), mp_policy=MixedPrecisionPolicy(), keep_norms_fp32=False)
        apply_fully_shard(model, units, mesh, root_mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                          reshard_after_forward=True)
    optimizer = make_optimizer(model)

    loader = token_loader(args, rank, world)
    model.train()
    clock = StepClock()
    n = total_steps(args)
    for step, (x, y) in enumerate(loader):
        clock.start()
        if step == n - 1:
            break
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        clock.end(loss.item())
    return clock, num_params


def _auto_policy():
    from fsdp_strategy.policy import normalize_policy

    return normalize_policy("auto", option="wrap_policy")


# --- Lightning --------------------------------------------------------------------------------------------------


class MPBenchModel(BenchModel):
    """The same model with the ``configure_model`` a user writes for ``ModelParallelStrategy``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

        if isinstance(self, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)
        # Lightning calls training_step, not forward: route it through the root's FSDP hooks.
        register_fsdp_forward_method(self, "training_step")


def run_lightning(args: argparse.Namespace) -> tuple[StepClock, int]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    clock = StepClock()

    class Timer(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clock.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.end(float(outputs["loss"]))

    if args.impl == "fsdp2":
        import fsdp_strategy  # noqa: F401  (registers "fsdp2")

        strategy, cls = "fsdp2", BenchModel
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy, cls = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), MPBenchModel

    torch.manual_seed(args.seed)
    model = build_model(**model_kwargs(args), cls=cls)
    model.log_loss = args.log_loss
    num_params = sum(p.numel() for p in model.parameters())
    world = int(os.environ.get("WORLD_SIZE", "2"))
    loader = token_loader(args, int(os.environ.get("RANK", "0")), world)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        max_steps=total_steps(args),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[Timer()],
    )
    trainer.fit(model, train_dataloaders=loader)
    return clock, num_params


# --- main -------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t_start = time.perf_counter()
    if args.impl in ("raw", "raw_plan"):
        clock, num_params = run_raw(args, "blocks+root" if args.impl == "raw" else "strategy")
    else:
        clock, num_params = run_lightning(args)
    t_end = time.perf_counter()

    result = clock.summary(args.warmup, args.steps) if len(clock.starts) >= total_steps(args) else None
    medians = [None]
    if dist.is_available() and dist.is_initialized():
        medians = [None] * dist.get_world_size()
        dist.all_gather_object(medians, result["median_s"] if result else None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        return {}
    if result is None:
        raise RuntimeError(f"only {len(clock.starts)} of {total_steps(args)} steps ran")

    import lightning

    record = {
        "impl": args.impl,
        "tag": args.tag,
        **result,
        "median_per_rank_s": medians,
        "run_s": t_end - t_start,
        "process_s": t_end - _T0,
        "model_source": MODEL_SOURCE,
        "num_params": num_params,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "n_embd": args.n_embd,
        "seq_len": args.seq_len,
        "vocab_size": args.vocab_size,
        "batch_size_per_rank": args.batch_size,
        "world_size": len(medians),
        "warmup": args.warmup,
        "steps": args.steps,
        "log_loss": args.log_loss,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }
    line = json.dumps(record)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            f.write(line + "\n")
    brief = {k: v for k, v in record.items() if k not in ("step_times_s", "step_cpu_s")}
    print("[step_time] " + json.dumps(brief), flush=True)
    return record


if __name__ == "__main__":
    main()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
