"""Step time of ``"fsdp2_hybrid"`` over ``"fsdp2"`` on a simulated cluster of 2 nodes x 2 processes.

    OMP_NUM_THREADS=1 python benchmarks/multinode_step_time.py --jobs 2 --pairs 5

Each job is a 2-node job on this machine: two torchrun invocations (``--nnodes 2 --node-rank 0/1
--nproc-per-node 2``, static rendezvous on 127.0.0.1). Its ranks run ``--pairs`` pairs of fits, one
``Trainer(num_nodes=2, devices=2, strategy=...)`` per fit, one fit of each strategy per pair, the order
alternating from pair to pair (and from job to job), all on the same model, initial weights and
batches (``benchmarks/_model.py``, fp32, AdamW, gloo). Fits in one job share its processes, so the pairs
are seconds apart and a change in the machine's load falls on both sides alike. ``"fsdp2"`` shards over
all 4 ranks (1-D mesh); ``"fsdp2_hybrid"`` shards within a node and replicates across the two (mesh
``(dp_replicate=2, dp_shard=2)``). Each fit reports rank 0's median step (time between consecutive batch
starts) in wall and in CPU time; the headline is the median over all pairs of the per-pair ratio
hybrid / fsdp2. ``--jobs 10 --pairs 1`` gives one fresh job per pair instead. Results go to
``benchmarks/results/multinode_step_time.json``.

On one machine the "inter-node" traffic goes over loopback like the rest, so the ratio reflects the
number and size of the collectives each layout issues, not a network.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # testkit/, beside the package

from testkit import free_port

HERE = Path(__file__).resolve().parent
STRATEGIES = ("fsdp2", "fsdp2_hybrid")
NODES = 2
MODEL_OPTIONS = {"--n-layer": 4, "--n-head": 4, "--n-embd": 96, "--seq-len": 64, "--batch-size": 2, "--vocab-size": 256}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2, help="fresh 2-node jobs, one after the other")
    p.add_argument("--pairs", type=int, default=5, help="pairs of fits (one per strategy) in each job")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--seed", type=int, default=0)
    for option, default in MODEL_OPTIONS.items():
        p.add_argument(option, type=int, default=default)
    p.add_argument("--run-timeout", type=float, default=900, help="seconds before a job is killed")
    p.add_argument("--out", type=Path, default=HERE / "results" / "multinode_step_time.json")
    # Set by the driver for each rank: the strategies to fit in turn, comma-separated.
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- one rank of one job ---------------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))  # step_time.py and _model.py
    records = [time_one_fit(strategy, args) for strategy in args.worker.split(",")]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(records))


def time_one_fit(strategy: str, args: argparse.Namespace) -> dict:
    """One ``Trainer.fit``; rank 0's step times and the other ranks' median steps."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from _model import MODEL_SOURCE, build_model
    from step_time import StepClock, model_kwargs, token_loader, total_steps

    import fsdp_strategy  # noqa: F401  (registers the strategy names)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    clock = StepClock()

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            clock.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            clock.end(float(outputs["loss"]))

    torch.manual_seed(args.seed)
    model = build_model(**model_kwargs(args))
    trainer = L.Trainer(
        accelerator="cpu",
        num_nodes=NODES,
        devices=args.nproc_per_node,
        strategy=strategy,
        max_steps=total_steps(args),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,  # the loader below already splits the batches over all ranks, unshuffled
        callbacks=[Timer()],
    )
    trainer.fit(model, train_dataloaders=token_loader(args, rank, world))
    summary = clock.summary(args.warmup, args.steps)
    medians: list = [None] * world
    dist.all_gather_object(medians, summary["median_s"])
    return {
        "strategy": strategy,
        "mesh_shape": list(trainer.strategy.device_mesh.shape),
        "median_per_rank_s": medians,
        "num_params": sum(p.numel() for p in model.parameters()),
        "model_source": MODEL_SOURCE,
        **summary,
    }


# --- the driver --------------------------------------------------------------------------------------------------


def worker_options(args: argparse.Namespace) -> list[str]:
    options = {
        "--nproc-per-node": args.nproc_per_node,
        "--warmup": args.warmup,
        "--steps": args.steps,
        "--seed": args.seed,
    }
    options |= {option: getattr(args, option[2:].replace("-", "_")) for option in MODEL_OPTIONS}
    return [str(item) for pair in options.items() for item in pair]


def launch_job(strategies: list[str], args: argparse.Namespace) -> list[dict]:
    """One 2-node job fitting ``strategies`` in turn: both torchrun invocations at once; returns rank 0's
    record of each fit."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        procs, logs = [], []
        for node in range(NODES):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(NODES),
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(args.nproc_per_node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(Path(__file__).resolve()),
                "--worker",
                ",".join(strategies),
                "--out",
                str(out),
                *worker_options(args),
            ]
            log = open(Path(tmp) / f"node{node}.log", "w+")
            logs.append(log)
            # PYTHONPATH: the ranks import this checkout's fsdp_strategy, installed or not.
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(HERE.parent))
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + args.run_timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: torchrun and its workers
            proc.wait()
        if not out.exists():
            for node, log in enumerate(logs):
                log.seek(0)
                sys.stderr.write(f"--- node {node} ---\n" + "\n".join(log.read().splitlines()[-30:]) + "\n")
            raise RuntimeError(f"the job {','.join(strategies)} failed: exit codes {[p.returncode for p in procs]}")
        for log in logs:
            log.close()
        return json.loads(out.read_text())


def summarize(pairs: list[dict[str, dict]]) -> dict:
    hybrid, full = STRATEGIES[1], STRATEGIES[0]
    summary: dict = {"per_strategy": {}, "ratios": {}}
    for strategy in STRATEGIES:
        summary["per_strategy"][strategy] = {
            "run_medians_s": [pair[strategy]["median_s"] for pair in pairs],
            "run_cpu_s": [pair[strategy]["median_cpu_s"] for pair in pairs],
            "median_s": statistics.median(pair[strategy]["median_s"] for pair in pairs),
            "median_cpu_s": statistics.median(pair[strategy]["median_cpu_s"] for pair in pairs),
        }
    for kind, key in (("wall", "median_s"), ("cpu", "median_cpu_s")):
        per_pair = [pair[hybrid][key] / pair[full][key] for pair in pairs]
        summary["ratios"][kind] = {
            "median_of_pair_ratios": statistics.median(per_pair),
            "ratio_of_medians": summary["per_strategy"][hybrid][key] / summary["per_strategy"][full][key],
            "pair_ratios": per_pair,
        }
    return summary


def markdown(summary: dict) -> str:
    lines = [
        "| strategy | median step (ms) | per-pair run medians (ms) | CPU / step, rank 0 (ms) | per-pair CPU (ms) |",
        "|---|---:|---|---:|---|",
    ]
    for strategy, s in summary["per_strategy"].items():
        runs = ", ".join(f"{1e3 * t:.1f}" for t in s["run_medians_s"])
        cpu = ", ".join(f"{1e3 * t:.1f}" for t in s["run_cpu_s"])
        lines.append(f"| `{strategy}` | {1e3 * s['median_s']:.1f} | {runs} | {1e3 * s['median_cpu_s']:.1f} | {cpu} |")
    lines += [
        "",
        "| fsdp2_hybrid / fsdp2 | median of per-pair ratios | ratio of medians | per-pair ratios |",
        "|---|---:|---:|---|",
    ]
    for kind, r in summary["ratios"].items():
        per_pair = ", ".join(f"{x:.3f}" for x in r["pair_ratios"])
        lines.append(f"| {kind} | **{r['median_of_pair_ratios']:.3f}** | {r['ratio_of_medians']:.3f} | {per_pair} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    import lightning
    import torch

    pairs = []
    for job in range(args.jobs):
        orders = [
            STRATEGIES if (job * args.pairs + index) % 2 == 0 else STRATEGIES[::-1] for index in range(args.pairs)
        ]
        started = time.monotonic()
        records = launch_job([strategy for order in orders for strategy in order], args)
        for index in range(args.pairs):
            pair = {record["strategy"]: record for record in records[2 * index : 2 * index + 2]}
            pairs.append(pair)
            print(
                f"job {job + 1}/{args.jobs}, pair {index + 1}/{args.pairs} ({', '.join(orders[index])}): "
                + ", ".join(
                    f"{s} {1e3 * pair[s]['median_s']:.1f} ms (cpu {1e3 * pair[s]['median_cpu_s']:.1f})"
                    for s in STRATEGIES
                ),
                flush=True,
            )
        print(f"job {job + 1}/{args.jobs} took {time.monotonic() - started:.0f} s", flush=True)
    losses = {s: [pair[s]["loss_last_timed"] for pair in pairs] for s in STRATEGIES}
    summary = summarize(pairs)
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "load_avg": os.getloadavg(),
        },
        "settings": vars(args) | {"out": str(args.out)},
        "last_timed_loss": losses,
        "summary": summary,
        "pairs": pairs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(markdown(summary))
    meshes = ", ".join(f"{s} {pairs[0][s]['mesh_shape']}" for s in STRATEGIES)
    print(f"mesh shapes: {meshes}; parameters: {pairs[0][STRATEGIES[0]]['num_params']:,}; last timed loss: {losses}")


if __name__ == "__main__":
    main()
