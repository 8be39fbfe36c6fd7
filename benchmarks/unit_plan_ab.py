"""Diagnostic: what does FSDP2Strategy's choice of sharded units cost per step, without Lightning?

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/unit_plan_ab.py

Two copies of the same model (same initial weights) live in one process pair:

* ``A`` (``blocks+root``): ``fully_shard`` on each transformer block, then on the model, as a user writes it;
* ``B`` (``strategy plan``): the units ``FSDP2Strategy`` shards (``fsdp_strategy.parallelize.plan_units`` with
  ``wrap_policy="auto"``, then ``apply_fully_shard``): the blocks, plus every other direct child that owns
  parameters and shares none (for examples/gpt.py's GPT: ``pos_emb`` and ``ln_f``), then the root.

Steps of A and B alternate in ABBA order in the same raw loop, so slow drifts of a shared machine's load hit both
alike; the per-pair ratio B/A and difference B-A are reported (medians). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _model import MODEL_SOURCE, build_model, lm_loss, make_optimizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4, help="untimed steps of each model")
    p.add_argument("--pairs", type=int, default=40, help="timed ABBA pairs (each model steps 2x this)")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from fsdp_strategy.parallelize import apply_fully_shard, plan_units
    from fsdp_strategy.policy import normalize_policy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    kwargs = dict(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                  n_embd=args.n_embd)

    torch.manual_seed(0)
    model_a = build_model(**kwargs)
    for block in model_a.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model_a, mesh=mesh)

    torch.manual_seed(0)
    model_b = build_model(**kwargs)
    units = plan_units(model_b, normalize_policy("auto", option="wrap_policy"), mp_policy=MixedPrecisionPolicy(),
                       keep_norms_fp32=False)
    apply_fully_shard(model_b, units, mesh, root_mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                      reshard_after_forward=True)

    models = {"A": model_a, "B": model_b}
    optimizers = {k: make_optimizer(m) for k, m in models.items()}
    g = torch.Generator().manual_seed(1234 + rank)
    batches = [torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=g) for _ in range(8)]

    def step(key: str, i: int) -> float:
        tokens = batches[i % len(batches)]
        dist.barrier()
        t0 = time.perf_counter()
        loss = lm_loss(models[key](tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizers[key].step()
        optimizers[key].zero_grad()
        return time.perf_counter() - t0

    for i in range(args.warmup):
        step("A", i)
        step("B", i)
    times = {"A": [], "B": []}
    for i in range(args.pairs):
        order = "AB" if i % 2 == 0 else "BA"
        for key in order:
            times[key].append(step(key, i))
    if rank == 0:
        ratios = [b / a for a, b in zip(times["A"], times["B"])]
        deltas = [b - a for a, b in zip(times["A"], times["B"])]
        record = {
            "model_source": MODEL_SOURCE,
            "units_A": [name for name, m in model_a.named_modules() if hasattr(m, "reshard")],
            "units_B": [u.name for u in units] + ["<root>"],
            "median_A_s": statistics.median(times["A"]),
            "median_B_s": statistics.median(times["B"]),
            "median_ratio_B_over_A": statistics.median(ratios),
            "median_delta_ms": 1e3 * statistics.median(deltas),
            "pairs": args.pairs,
            "config": vars(args),
        }
        print("[unit_plan_ab] " + json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
