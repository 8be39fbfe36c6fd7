"""Interleaved step-time comparison: ``Trainer(strategy="fsdp2")`` vs a raw FSDP2 loop vs ``ModelParallelStrategy``.

    python benchmarks/run_step_time.py                      # 5 rounds of raw, fsdp2, model_parallel
    python benchmarks/run_step_time.py --rounds 3 --steps 40 --impls raw,fsdp2,raw_plan

Every round launches each implementation once, as a fresh ``torchrun --standalone --nproc-per-node 2`` job with
``OMP_NUM_THREADS=1`` (``benchmarks/step_time.py``), one after the other; the order rotates from round to round
so that no implementation always runs first or last. Each run reports the median of its timed steps. On a shared,
noisy machine the load changes over minutes, so the comparison is made inside each round (per-round ratios, whose
median is the headline number) as well as across rounds (median over rounds of each run's median). Rank 0's CPU
time per step is summarized the same way: on an oversubscribed machine it is far less disturbed by other jobs
than wall time, and Python-side overhead (Lightning's loop, FSDP hooks) is CPU time.

Options not listed below (``--n-layer``, ``--n-embd``, ``--seq-len``, ``--batch-size``, ``--log-loss``, ...) are
passed on to ``step_time.py``. Results go to ``benchmarks/results/step_time.json`` (all runs, every step time) and
a markdown table is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
STEP_TIME = os.path.join(HERE, "step_time.py")

# (numerator, denominator): the ratios the targets are about come first.
RATIOS = [("fsdp2", "raw"), ("fsdp2", "model_parallel"), ("model_parallel", "raw"), ("fsdp2", "raw_plan"),
          ("raw_plan", "raw")]
TARGETS = {("fsdp2", "raw"): 1.03, ("fsdp2", "model_parallel"): 1.0}


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--impls", default="raw,fsdp2,model_parallel",
                   help="comma-separated: raw, fsdp2, model_parallel, raw_plan")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    p.add_argument("--no-rotate", action="store_true", help="the same order in every round")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds before a run is killed")
    p.add_argument("--out", default=os.path.join(HERE, "results", "step_time.json"))
    return p.parse_known_args()


def launch(impl: str, args: argparse.Namespace, extra: list[str], tag: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               STEP_TIME, "--impl", impl, "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--tag", tag, "--out", out, *extra]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=args.run_timeout)
        wall = time.perf_counter() - t0
        if not os.path.exists(out):
            sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
            raise RuntimeError(f"{impl} ({tag}) failed with exit code {proc.returncode}: {' '.join(cmd)}")
        if proc.returncode != 0:
            # The result was written; a process died after that, at shutdown (seen once: a rank aborting
            # with "terminate called without an active exception" after destroy_process_group).
            print(f"warning: {impl} ({tag}) exited with code {proc.returncode} after writing its result;"
                  f" kept. Last output: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}", file=sys.stderr)
        with open(out) as f:
            record = json.loads(f.read().strip().splitlines()[-1])
    record["launch_wall_s"] = wall
    record["exit_code"] = proc.returncode
    return record


def median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(impls: list[str], rounds: list[dict[str, dict]]) -> dict:
    per_impl = {}
    for impl in impls:
        medians = [r[impl]["median_s"] for r in rounds]
        pooled = [t for r in rounds for t in r[impl]["step_times_s"]]
        per_impl[impl] = {
            "median_of_run_medians_s": median(medians),
            "run_medians_s": medians,
            "pooled_median_s": median(pooled),
            "median_of_run_inner_s": median([r[impl]["median_inner_s"] for r in rounds]),
            "median_of_run_min_s": median([r[impl]["min_s"] for r in rounds]),
            "median_of_run_cpu_s": median([r[impl]["median_cpu_s"] for r in rounds]),
            "run_cpu_s": [r[impl]["median_cpu_s"] for r in rounds],
        }
    ratios = {}
    for num, den in RATIOS:
        if num in impls and den in impls:
            per_round = [r[num]["median_s"] / r[den]["median_s"] for r in rounds]
            ratios[f"{num}/{den}"] = {
                "median_of_round_ratios": median(per_round),
                "ratio_of_medians": per_impl[num]["median_of_run_medians_s"] / per_impl[den]["median_of_run_medians_s"],
                "round_ratios": per_round,
                "min": min(per_round),
                "max": max(per_round),
                "target": TARGETS.get((num, den)),
                "delta_ms_median": 1e3 * median([r[num]["median_s"] - r[den]["median_s"] for r in rounds]),
            }
            cpu_round = [r[num]["median_cpu_s"] / r[den]["median_cpu_s"] for r in rounds]
            ratios[f"{num}/{den} (cpu)"] = {
                "median_of_round_ratios": median(cpu_round),
                "ratio_of_medians": per_impl[num]["median_of_run_cpu_s"] / per_impl[den]["median_of_run_cpu_s"],
                "round_ratios": cpu_round,
                "min": min(cpu_round),
                "max": max(cpu_round),
                "target": TARGETS.get((num, den)),
                "delta_ms_median": 1e3 * median([r[num]["median_cpu_s"] - r[den]["median_cpu_s"] for r in rounds]),
            }
    return {"per_impl": per_impl, "ratios": ratios}


def markdown(impls: list[str], rounds: list[dict[str, dict]], summary: dict) -> str:
    lines = ["| impl | median step (ms), median over rounds | per-round medians (ms) | inner (ms) | pooled median (ms)"
             " | CPU time / step, rank 0 (ms) | per-round CPU medians (ms) |",
             "|---|---:|---|---:|---:|---:|---|"]
    for impl in impls:
        s = summary["per_impl"][impl]
        runs = ", ".join(f"{1e3 * m:.1f}" for m in s["run_medians_s"])
        cpu_runs = ", ".join(f"{1e3 * m:.1f}" for m in s["run_cpu_s"])
        lines.append(f"| {impl} | {1e3 * s['median_of_run_medians_s']:.1f} | {runs} | "
                     f"{1e3 * s['median_of_run_inner_s']:.1f} | {1e3 * s['pooled_median_s']:.1f} | "
                     f"{1e3 * s['median_of_run_cpu_s']:.1f} | {cpu_runs} |")
    lines += ["", "| ratio | median of per-round ratios | ratio of medians | per-round ratios | median delta (ms) | target |",
              "|---|---:|---:|---|---:|---|"]
    for name, r in summary["ratios"].items():
        per_round = ", ".join(f"{x:.3f}" for x in r["round_ratios"])
        target = "" if r["target"] is None else (
            f"<= {r['target']:.2f}: {'met' if r['median_of_round_ratios'] <= r['target'] else 'NOT met'}")
        lines.append(f"| {name} | {r['median_of_round_ratios']:.3f} | {r['ratio_of_medians']:.3f} | {per_round} | "
                     f"{r['delta_ms_median']:+.1f} | {target} |")
    return "\n".join(lines)


def main() -> None:
    args, extra = parse_args()
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    started = time.perf_counter()
    rounds: list[dict[str, dict]] = []
    order_log = []
    for r in range(args.rounds):
        shift = 0 if args.no_rotate else r % len(impls)
        order = impls[shift:] + impls[:shift]
        order_log.append(order)
        results = {}
        for impl in order:
            load = os.getloadavg()[0]
            rec = launch(impl, args, extra, tag=f"round={r}")
            rec["loadavg_1min_before"] = load
            results[impl] = rec
            print(f"round {r} {impl:>15}: median {1e3 * rec['median_s']:7.1f} ms  inner {1e3 * rec['median_inner_s']:7.1f}"
                  f" ms  min {1e3 * rec['min_s']:7.1f} ms  cpu {1e3 * rec['median_cpu_s']:7.1f} ms  load {load:4.1f}  loss {rec['loss_last_timed']:.6f}"
                  f"  ({rec['launch_wall_s']:.0f} s)", flush=True)
        rounds.append(results)
        print(f"round {r}: " + "  ".join(
            f"{n}/{d} {results[n]['median_s'] / results[d]['median_s']:.3f}"
            f" (cpu {results[n]['median_cpu_s'] / results[d]['median_cpu_s']:.3f})"
            for n, d in RATIOS if n in results and d in results), flush=True)

    summary = summarize(impls, rounds)
    table = markdown(impls, rounds, summary)
    first = rounds[0][impls[0]]
    losses = {impl: sorted({r[impl]["loss_last_timed"] for r in rounds}) for impl in impls}
    import lightning
    import torch

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "lightning": lightning.__version__, "backend": "gloo",
                    "threads_per_rank": args.threads, "nproc": args.nproc},
        "config": {k: first[k] for k in ("model_source", "num_params", "n_layer", "n_head", "n_embd", "seq_len",
                                          "vocab_size", "batch_size_per_rank", "world_size", "warmup", "steps",
                                          "log_loss")},
        "extra_args": extra,
        "orders": order_log,
        "final_losses": losses,
        "summary": summary,
        "markdown": table,
        "total_wall_s": time.perf_counter() - started,
        "runs": [rec for rnd in rounds for rec in rnd.values()],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print()
    print(f"model: {report['config']}")
    print(f"last-timed-step loss per impl (identical = same model, data and math): {losses}")
    print()
    print(table)
    print(f"\nwrote {os.path.relpath(args.out, REPO_ROOT)}  ({report['total_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
