"""One benchmark run on one rank. ``fsdp-strategy benchmark`` launches it as a fresh torchrun job:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m fsdp_strategy.tools.benchmark.worker --strategy fsdp2 --model fsdp_strategy.tools.benchmark.gpt:GPT \\
        --init-args '{"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}' --seq-len 64 --out DIR

Every strategy trains the same model (built eagerly from the same seed, so with the same weights), on the same
batches of random token ids, with the same loss (next-token cross-entropy) and the same AdamW:

* ``ddp``, ``fsdp2``, ``fsdp2_grad_op``: ``Trainer(strategy=<name>)``, the model unchanged;
* ``model_parallel``: Lightning's ``ModelParallelStrategy`` and the ``configure_model`` a user writes for it:
  ``fully_shard`` on each block, then on the LightningModule;
* ``raw_fsdp2``: no Lightning Trainer, the same ``fully_shard`` calls and a plain loop (the floor).

The model's ``forward`` must map token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``. Its blocks are
the modules the ``"auto"`` wrap policy finds (the repeated children of a ``ModuleList``).

Each rank writes ``DIR/rank<R>.json``: resident memory after imports and at its peak, the bytes of its
parameters, gradients and optimizer state (local shards), and its step times after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fsdp_strategy  # noqa: F401  (registers "fsdp2" and "fsdp2_grad_op")
from fsdp_strategy import host_memory
from fsdp_strategy.launch import rendezvous
from fsdp_strategy.monitor.memory import current_rss_bytes, peak_rss_bytes
from fsdp_strategy.sharding.mixed_precision import mixed_precision_policy
from fsdp_strategy.sharding.policy import normalize_policy, select_modules
from fsdp_strategy.sharding.state_bytes import (
    full_bytes,
    held_bytes,
    model_state_tensors,
)
from fsdp_strategy.tools.benchmark.options import (
    PRECISIONS,
    PROGRESS_PREFIX,
    load_model_class,
    parse_variant,
)

SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--strategy", type=_variant, required=True, help="a strategy or a variant (fsdp2:OPTION=VALUE)")
    p.add_argument("--model", required=True, help="MODULE:Class of a LightningModule")
    p.add_argument("--init-args", default="{}", help="JSON object of the model's constructor arguments")
    p.add_argument("--precision", choices=PRECISIONS, default="32-true")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--out", required=True, help="directory for rank<R>.json")
    return p.parse_args(argv)


def _variant(text: str) -> str:
    parse_variant(text)  # a wrong one fails here, named
    return text


# --- the shared model, data, loss and optimizer -------------------------------------------------------------------


def next_token_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (a tied weight appears once in ``parameters()``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))


def token_loader(args: argparse.Namespace, rank: int, world_size: int) -> DataLoader:
    """Fixed random token ids, the same for every strategy; rank ``rank``'s share in order."""
    samples = batches_per_run(args) * args.batch_size * world_size
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, args.vocab_size, (samples, args.seq_len + 1), generator=generator)
    dataset = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)


def batches_per_run(args: argparse.Namespace) -> int:
    # One batch more than warm-up + timed steps: the last timed step ends where the next batch starts.
    return args.warmup + args.steps + 1


def shard_by_hand(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """What a user writes: ``fully_shard`` each block, then the whole model."""
    for _, block in select_modules(model, normalize_policy("auto", option="wrap_policy")):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def _training_step(self: L.LightningModule, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
    return next_token_loss(self, batch)


def _configure_optimizers(self: L.LightningModule) -> torch.optim.Optimizer:
    return make_optimizer(self)


def _configure_model_by_hand(self: L.LightningModule) -> None:
    if isinstance(self, FSDPModule):
        return
    shard_by_hand(
        self,
        self.device_mesh["data_parallel"],
        mixed_precision_policy(self.trainer.precision) or MixedPrecisionPolicy(),
    )
    # Lightning calls training_step, not forward: route it through the root's FSDP hooks.
    register_fsdp_forward_method(self, "training_step")


def benchmark_class(cls: type[L.LightningModule], strategy: str) -> type[L.LightningModule]:
    """``cls`` with the benchmark's training step and optimizer (and ``configure_model`` for model_parallel)."""
    namespace = {"training_step": _training_step, "configure_optimizers": _configure_optimizers}
    if strategy == "model_parallel":
        namespace["configure_model"] = _configure_model_by_hand
    return type(cls.__name__, (cls,), namespace)


# --- measuring a run -----------------------------------------------------------------------------------------------


class StepLog:
    """Wall and CPU time at each batch start; the gradients' bytes, taken once before an optimizer step."""

    def __init__(self, total_batches: int, progress: bool) -> None:
        self.total_batches, self.progress = total_batches, progress
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.grad_bytes = (0, 0)
        self.losses: list[float] = []
        self.rss: list[int | None] = []  # at each batch start: where the growth happens
        self.train_peak = 0  # peak RSS when training ended, before the strategy's teardown gathers anything
        self.train_end = 0.0  # wall time then
        self.stage_end_s = 0.0  # from the end of training to fit's return: the strategy's teardown (giving back)

    def batch_start(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.rss.append(current_rss_bytes())
        if self.progress:
            print(f"{PROGRESS_PREFIX} {len(self.wall)}/{self.total_batches}", flush=True)

    def before_optimizer_step(self, params: Iterable[Tensor]) -> None:
        if self.grad_bytes == (0, 0):
            grads = [p.grad for p in params if p.grad is not None]
            self.grad_bytes = held_bytes(grads), full_bytes(grads)

    def step_times(self, warmup: int, steps: int) -> tuple[list[float], list[float]]:
        timed = range(warmup, warmup + steps)
        return [self.wall[i + 1] - self.wall[i] for i in timed], [self.cpu[i + 1] - self.cpu[i] for i in timed]


class _Probe(Callback):
    def __init__(self, log: StepLog) -> None:
        self.step_log = log
        self.model_state: tuple[int, int] = (0, 0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.step_log.batch_start()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        self.step_log.before_optimizer_step(pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.step_log.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self.step_log.train_peak = peak_rss_bytes()
        self.step_log.train_end = time.perf_counter()
        self.model_state = held_and_full_state_bytes(pl_module, trainer.optimizers[0], self.step_log.grad_bytes)


def held_and_full_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, grads: tuple[int, int]
) -> tuple[int, int]:
    """Model state as this rank holds it and whole, with the gradients' bytes taken before a step
    (the plain loop's ``zero_grad`` frees them)."""
    tensors = model_state_tensors(model, [optimizer], gradients=False)
    return held_bytes(tensors) + grads[0], full_bytes(tensors) + grads[1]


def run_lightning(
    args: argparse.Namespace, cls: type, init_args: dict, log: StepLog, rank: int, world_size: int
) -> tuple:
    from lightning.pytorch.strategies import ModelParallelStrategy

    variant = parse_variant(args.strategy)
    strategy: Any = variant.strategy
    if strategy == "model_parallel":
        strategy = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    elif variant.options or variant.strategy.startswith("fsdp2"):
        from lightning.pytorch.strategies import StrategyRegistry

        registered = StrategyRegistry[variant.strategy]
        options = {**registered["init_params"], **variant.options}
        if variant.strategy.startswith("fsdp2"):  # the probe reads the gradients as each rank holds them
            options = {"hook_view": "sharded", **options}
        strategy = registered["strategy"](**options)
    probe = _Probe(log)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        precision=args.precision,
        max_steps=batches_per_run(args),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,  # Lightning's own sampler shuffles: the strategies would see other batches
        callbacks=[probe],
    )
    torch.manual_seed(SEED)
    with trainer.init_module(empty_init=True) if variant.init == "meta" else nullcontext():
        model = benchmark_class(cls, variant.strategy)(**init_args)
    trainer.fit(model, train_dataloaders=token_loader(args, rank, world_size))
    log.stage_end_s = time.perf_counter() - log.train_end
    return probe.model_state, sum(p.numel() for p in model.parameters())


def run_raw(args: argparse.Namespace, cls: type, init_args: dict, log: StepLog, rank: int, world_size: int) -> tuple:
    dist.init_process_group("gloo")
    rendezvous.finish_collectives_at_exit()  # gloo threads finish before Python does (docs/gloo_exit_abort.py)
    mixed = mixed_precision_policy(args.precision)
    torch.manual_seed(SEED)
    model = benchmark_class(cls, args.strategy)(**init_args)
    shard_by_hand(model, init_device_mesh("cpu", (world_size,)), mixed or MixedPrecisionPolicy())
    optimizer = make_optimizer(model)
    model.train()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else nullcontext()
    for batch in token_loader(args, rank, world_size):  # every batch a full step, as in the Trainer runs
        log.batch_start()
        with autocast:
            loss = next_token_loss(model, batch)
        loss.backward()
        log.before_optimizer_step(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        log.losses.append(loss.item())
    log.train_peak = peak_rss_bytes()
    state = held_and_full_state_bytes(model, optimizer, log.grad_bytes)
    return state, sum(p.numel() for p in model.parameters())


def result_row(
    args: argparse.Namespace,
    *,
    rank: int,
    world_size: int,
    params: int,
    state: tuple[int, int],
    log: StepLog,
    rss_after_imports: int,
) -> dict:
    walls, cpus = log.step_times(args.warmup, args.steps)
    step_time = statistics.median(walls)
    peak = peak_rss_bytes()
    heap = host_memory.heap_stats()
    return {
        "strategy": args.strategy,
        "world_size": world_size,
        "rank": rank,
        "params": params,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "rss_after_imports_bytes": rss_after_imports,
        "peak_rss_bytes": peak,
        "growth_bytes": peak - rss_after_imports,
        # Up to the end of training: "fsdp2" gives the module back in full after fit (as DDP leaves it), and
        # that gathered state counts in growth_bytes, not here.
        "train_growth_bytes": log.train_peak - rss_after_imports,
        "stage_end_s": log.stage_end_s,
        "model_state_bytes": state[0],
        "model_state_total_bytes": state[1],
        "model_state_over_ideal": state[0] / (state[1] / world_size),
        "step_time_s": step_time,
        "cpu_time_s": statistics.median(cpus),
        "samples_per_s": world_size * args.batch_size / step_time,
        "tokens_per_s": world_size * args.batch_size * args.seq_len / step_time,
        "loss_last": log.losses[args.warmup + args.steps - 1],
        "step_times_s": walls,
        "rss_at_batch_start_bytes": log.rss,
        "heap_at_end": None if heap is None else asdict(heap),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cls = load_model_class(args.model)  # the model's own imports count as imports too
    rss_after_imports = current_rss_bytes()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log = StepLog(batches_per_run(args), progress=rank == 0)
    run = run_raw if args.strategy == "raw_fsdp2" else run_lightning
    state, params = run(args, cls, json.loads(args.init_args), log, rank, world_size)
    row = result_row(
        args, rank=rank, world_size=world_size, params=params, state=state, log=log, rss_after_imports=rss_after_imports
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(row))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
