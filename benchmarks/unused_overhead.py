"""What handling unused parameters costs when every parameter is used, step by step in one process pair.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/unused_overhead.py --n-layer 6 --n-head 6 --n-embd 384 --seq-len 128 --batch-size 4

Two copies of the benchmark's GPT (same initial weights, same batches, AdamW), each sharded as the
strategy shards it (each block, then the root, which stays gathered after forward), train side by side,
as two of (``--sides A,B``, default ``plain,tracked``): ``plain``, FSDP2 alone; ``tracked``, with
:class:`fsdp_strategy.step.unused.UnusedParameters` (zero-filled reduce-scatter, a hook on every unsharded
parameter, one all-reduce of the used-record per step, not waited for when every parameter was used);
``checked``, that and :class:`fsdp_strategy.step.unit_order.UnitOrder` (a forward pre-hook on each block, the
digest in the same all-reduce, which every rank then waits for), as the strategy runs them. Their steps
alternate, each pair in the other order than the one before, so a change in the machine's load falls on
both sides of a pair. Prints, for wall time and for rank 0's CPU time (``time.process_time()``, all
threads), the median per-pair ratio B/A with its 10th and 90th percentiles, and each side's median.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_strategy.launch import rendezvous
from fsdp_strategy.sharding.policy import normalize_policy, select_modules
from fsdp_strategy.step.unit_order import UnitOrder
from fsdp_strategy.step.unused import UnusedParameters
from fsdp_strategy.tools.benchmark.gpt import GPT
from fsdp_strategy.tools.benchmark.worker import (
    make_optimizer,
    next_token_loss,
    token_loader,
)


def shard(model: torch.nn.Module, mesh) -> None:  # type: ignore[no-untyped-def]
    for _, block in select_modules(model, normalize_policy("auto", option="wrap_policy")):
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(), reshard_after_forward=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="timed pairs of steps")
    p.add_argument("--sides", default="plain,tracked", help="two of plain, tracked, checked: baseline,candidate")
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rendezvous.finish_collectives_at_exit()  # gloo threads finish before Python does (docs/gloo_exit_abort.py)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    kinds = dict(zip("ab", args.sides.split(","), strict=True))  # a: the baseline, b: the candidate
    torch.manual_seed(0)
    first = GPT(
        vocab_size=args.vocab_size,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    sides = {}
    for side, model in (("a", first), ("b", copy.deepcopy(first))):
        shard(model, mesh)
        tracker = UnusedParameters(model) if kinds[side] in ("tracked", "checked") else None
        order = UnitOrder(model) if kinds[side] == "checked" else None
        sides[side] = (model, make_optimizer(model), tracker, order)
    args.steps += args.warmup
    batches = list(token_loader(args, rank, world))

    def step(side: str, batch) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
        model, optimizer, tracker, order = sides[side]
        t0, c0 = time.perf_counter(), time.process_time()
        loss = next_token_loss(model, batch)
        if order is not None:
            order.before_backward()
        if tracker is not None:
            tracker.before_backward()
        loss.backward()
        if order is not None:
            order.after_backward()
        if tracker is not None:
            tracker.after_backward(order=order)
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - t0, time.process_time() - c0, loss.item()

    wall: dict[str, list[float]] = {"a": [], "b": []}
    cpu: dict[str, list[float]] = {"a": [], "b": []}
    for i in range(args.steps):
        losses = {}
        for side in "ab" if i % 2 == 0 else "ba":
            w, c, losses[side] = step(side, batches[i])
            if i >= args.warmup:
                wall[side].append(w)
                cpu[side].append(c)
        assert abs(losses["a"] - losses["b"]) <= 1e-5 * abs(losses["a"]), losses
    for _, _, tracker, _ in sides.values():
        if tracker is not None:
            tracker.wait()

    def summary(times: dict[str, list[float]]) -> dict[str, float]:
        ratios = sorted(b / a for a, b in zip(times["a"], times["b"]))
        deciles = statistics.quantiles(ratios, n=10)
        return {
            "ratio_median": statistics.median(ratios),
            "ratio_p10": deciles[0],
            "ratio_p90": deciles[-1],
            f"{kinds['a']}_ms": 1e3 * statistics.median(times["a"]),
            f"{kinds['b']}{'_b' if kinds['a'] == kinds['b'] else ''}_ms": 1e3 * statistics.median(times["b"]),
        }

    if rank == 0:
        line = json.dumps(
            {"pairs": len(wall["a"]), "sides": args.sides, "wall": summary(wall), "cpu_rank0": summary(cpu)}
        )
        print(line)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
