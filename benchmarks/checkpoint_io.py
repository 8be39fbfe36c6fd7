"""Checkpoint save time: sharded (DCP) vs full (one file) vs async sharded, with FSDP2Strategy.

Run with two CPU ranks:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/checkpoint_io.py --repeats 3

What it does:
  * builds the ~100M-parameter ``StackModel`` (benchmarks/ckpt_common.py) once, fits one step with
    ``Trainer(strategy=FSDP2Strategy(), max_steps=1, ...)`` so AdamW state exists (~1.2 GB of state);
  * then, for each repeat, times the three modes interleaved (the order is rotated every repeat so drift on a
    noisy machine does not favour one mode), each saving with ``trainer.save_checkpoint(path)`` into a fresh
    path under a temp folder on the benchmark disk, deleted right after:
      - ``sharded``: ``state_dict_type="sharded"``, synchronous;
      - ``full``: ``state_dict_type="full"`` (rank 0 gathers model + optimizer on CPU and writes one file);
      - ``async``: ``state_dict_type="sharded", async_save=True``; ``stall`` = time until
        ``trainer.save_checkpoint`` returns (what the training loop is blocked for), ``total`` = time until
        ``strategy.wait_for_checkpoint()`` has returned as well (the checkpoint is published).
    All ranks pass a barrier right before each timed call.  Every timed interval includes Lightning's
    ``dump_checkpoint`` (state-dict gathering) and the barrier at the end of ``trainer.save_checkpoint``.
  * The mode is switched on the one fitted Trainer through the strategy's ``checkpoints`` (its ``format`` and
    ``async_save``; fitting a 100M model three times would cost more than the saves).

Rank 0 prints medians and ratios and writes benchmarks/results/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt_common as cc
import torch.distributed as dist

from fsdp_strategy.options import CheckpointFormat

MODES = ("sharded", "full", "async")
HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tmp", default=None, help="parent of the temporary checkpoint folder (default: $TMPDIR or /tmp)"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results", "checkpoint_io.json"))
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    parent = args.tmp or tempfile.gettempdir()
    if rank == 0:
        free = shutil.disk_usage(parent).free
        need = 3 * 2 * cc.n_params() * 4  # at most one checkpoint (~1.2 GB) on disk at a time; 2.5x margin
        print(f"[checkpoint_io] free space under {parent}: {free / 2**30:.1f} GiB", flush=True)
        if free < need:
            raise SystemExit(f"not enough free disk under {parent}: {free / 2**30:.1f} GiB < {need / 2**30:.1f} GiB")

    trainer, fit_s = cc.fit_one_step("sharded", async_save=False)
    strategy = trainer.strategy
    assert dist.is_initialized(), "run under torch.distributed.run"
    world = dist.get_world_size()

    workdir = strategy.broadcast(tempfile.mkdtemp(prefix="ckpt_io_", dir=parent) if rank == 0 else None)
    times: dict[str, list[float]] = {"sharded": [], "full": [], "async_stall": [], "async_total": []}
    sizes: dict[str, int] = {}
    try:
        for r in range(args.repeats):
            order = MODES[r % 3 :] + MODES[: r % 3]
            for mode in order:
                path = os.path.join(workdir, f"r{r}_{mode}" + (".ckpt" if mode == "full" else ""))
                strategy.checkpoints.format = CheckpointFormat.FULL if mode == "full" else CheckpointFormat.SHARDED
                strategy.checkpoints.async_save = mode == "async"
                gc.collect()
                dist.barrier()
                t0 = time.perf_counter()
                trainer.save_checkpoint(path)
                t1 = time.perf_counter()
                if mode == "async":
                    strategy.wait_for_checkpoint()
                    t2 = time.perf_counter()
                    times["async_stall"].append(t1 - t0)
                    times["async_total"].append(t2 - t0)
                else:
                    times[mode].append(t1 - t0)
                dist.barrier()
                if rank == 0:
                    sizes[mode] = cc.dir_bytes(path)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                    extra = f" (returned after {t1 - t0:.2f} s)" if mode == "async" else ""
                    total = (t2 - t0) if mode == "async" else (t1 - t0)
                    print(
                        f"[checkpoint_io] repeat {r} {mode:8s} {total:7.2f} s{extra}  {sizes[mode] / 2**20:.0f} MiB",
                        flush=True,
                    )
                dist.barrier()
    finally:
        strategy.checkpoints.async_save = False
        strategy.wait_for_checkpoint()
        if rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)

    if rank != 0:
        dist.barrier()
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        "sharded_over_full": med["sharded"] / med["full"],
        "async_stall_over_sharded_sync": med["async_stall"] / med["sharded"],
        "async_total_over_sharded_sync": med["async_total"] / med["sharded"],
    }
    state_bytes = 3 * cc.n_params() * 4
    result = {
        "model_params": cc.n_params(),
        "state_bytes_est": state_bytes,
        "world_size": world,
        "repeats": args.repeats,
        "fit_one_step_s": fit_s,
        "times_s": times,
        "median_s": med,
        "ratios_of_medians": ratios,
        "checkpoint_bytes": sizes,
        "tmp_parent": parent,
        "machine": cc.machine_note(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"[checkpoint_io] {cc.n_params() / 1e6:.1f}M params, {world} ranks, {args.repeats} repeats; medians (s):")
    for k, v in med.items():
        print(f"  {k:12s} {v:7.2f}   (all: {', '.join(f'{x:.2f}' for x in times[k])})")
    for k, v in ratios.items():
        print(f"  {k:32s} {v:.3f}")
    print(f"[checkpoint_io] wrote {args.out}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
