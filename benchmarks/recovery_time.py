"""Time from a rank killed with SIGKILL to training resumed, under ``torchrun --max-restarts 1``.

Each repeat trains the integration TinyLM on 2 CPU ranks with a checkpoint every 4 steps; rank 1 kills
itself at the start of step 6. Recovery time = first training batch of the restarted attempt minus the
moment of the kill. It includes torchrun noticing the death, stopping the survivor, starting two fresh
processes (Python, torch and Lightning imports), the rendezvous, sharding, and loading the checkpoint.
A clean start (launch to first batch, no kill) is measured in the same way, interleaved, for comparison.

    OMP_NUM_THREADS=1 python benchmarks/recovery_time.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def run_once(kill: bool, workdir: Path) -> float:
    out = workdir / "result.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "integration_tests.recovery_worker",
        "--checkpoint-dir",
        str(workdir / "ckpt"),
        "--out",
        str(out),
    ]
    if kill:
        cmd += ["--kill-at-step", "6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launched = time.time()
    subprocess.run(cmd, cwd=workdir, env=env, check=True, capture_output=True)
    result = torch.load(out)
    if kill:
        killed = json.loads(out.with_suffix(".killed").read_text())["time"]
        return result["first_batch_time"] - killed
    return result["first_batch_time"] - launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    args = parser.parse_args()
    figures: dict[str, list[float]] = {"recovery": [], "clean_start": []}
    for repeat in range(args.repeats):
        # Alternate the order so that drifting machine load hits both kinds alike.
        order = ("recovery", "clean_start") if repeat % 2 == 0 else ("clean_start", "recovery")
        for kind in order:
            with tempfile.TemporaryDirectory() as workdir:
                figures[kind].append(run_once(kind == "recovery", Path(workdir)))
        print(
            f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in figures.items()),
            flush=True,
        )
    for kind, values in figures.items():
        print(
            f"{kind}: median {statistics.median(values):.1f} s (min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
