"""Peak memory of ``python -m fsdp_strategy consolidate`` relative to the size of the model state.

    OMP_NUM_THREADS=1 python benchmarks/consolidate_memory.py [--repeats 2] [--tmp /tmp]

Steps (the script launches everything itself):
  1. ``torch.distributed.run --nproc-per-node 2`` runs this file with ``--create DIR``: fit the ~100M-parameter
     ``StackModel`` (benchmarks/ckpt_common.py) one step with FSDP2Strategy (AdamW state exists), then
     ``trainer.save_checkpoint(DIR)`` as a sharded checkpoint (~1.2 GB).
  2. Interleaved, ``--repeats`` times: (a) a process that only runs ``import fsdp_strategy``; (b) a process that
     imports what the CLI imports (``fsdp_strategy.tools.cli``, ``fsdp_strategy.tools.consolidate``); (c)
     ``python -m fsdp_strategy consolidate DIR OUT --no-progress`` (OUT deleted after each run).
     For each child the peak RSS is the kernel's ``ru_maxrss`` from ``os.wait4`` (exact, per child); a psutil
     poller (10 ms) records the same peak as a cross-check.
  3. Model-state bytes = sum over the tensors in the DCP ``.metadata`` of numel * element size
     (model params + AdamW exp_avg/exp_avg_sq + step counters).
Reported ratios (medians over repeats):
  * ``peak_over_state``        = peak RSS of consolidate / state bytes;
  * ``net_peak_over_state``    = (peak RSS of consolidate - RSS of the import-only process) / state bytes.
JSON goes to benchmarks/results/consolidate_memory.json; the checkpoint and outputs are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 2**20


def create(ckpt_dir: str) -> None:
    import ckpt_common as cc

    trainer, _ = cc.fit_one_step("sharded", async_save=False)
    trainer.save_checkpoint(ckpt_dir)


def run_measured(cmd: list[str], log_path: str) -> dict:
    """Runs ``cmd``; returns its exit code, wall time and peak RSS (ru_maxrss and psutil polling)."""
    import psutil

    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        polled = [0]
        done = threading.Event()

        def poll() -> None:
            try:
                p = psutil.Process(proc.pid)
                while not done.is_set():
                    polled[0] = max(polled[0], p.memory_info().rss)
                    time.sleep(0.01)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                pass

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        done.set()
        thread.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "wall_s": wall,
        "maxrss_bytes": usage.ru_maxrss * 1024,  # Linux: KiB
        "polled_peak_rss_bytes": polled[0],
    }


def state_bytes(ckpt_dir: str) -> tuple[int, int]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(ckpt_dir).read_metadata()
    total, n = 0, 0
    for meta in md.state_dict_metadata.values():
        if isinstance(meta, TensorStorageMetadata):
            numel = 1
            for s in meta.size:
                numel *= s
            total += numel * meta.properties.dtype.itemsize
            n += 1
    return total, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--create", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tmp", default=None)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "consolidate_memory.json"))
    args = parser.parse_args()
    if args.create:
        create(args.create)
        return

    import ckpt_common as cc

    parent = args.tmp or tempfile.gettempdir()
    free = shutil.disk_usage(parent).free
    print(f"[consolidate_memory] free space under {parent}: {free / 2**30:.1f} GiB", flush=True)
    if free < 6 * 2**30:
        raise SystemExit("need ~6 GiB free (checkpoint + consolidated file, ~2.4 GB)")
    workdir = tempfile.mkdtemp(prefix="ckpt_consolidate_", dir=parent)
    ckpt_dir, out_file = os.path.join(workdir, "sharded"), os.path.join(workdir, "consolidated.ckpt")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        t0 = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                os.path.abspath(__file__),
                "--create",
                ckpt_dir,
            ],
            check=True,
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        print(
            f"[consolidate_memory] sharded checkpoint written in {time.perf_counter() - t0:.1f} s: "
            f"{cc.dir_bytes(ckpt_dir) / MiB:.0f} MiB on disk",
            flush=True,
        )
        sbytes, ntensors = state_bytes(ckpt_dir)

        cmds = {
            "import_only": [sys.executable, "-c", "import fsdp_strategy"],
            "import_cli": [sys.executable, "-c", "import fsdp_strategy.tools.cli, fsdp_strategy.tools.consolidate"],
            "consolidate": [sys.executable, "-m", "fsdp_strategy", "consolidate", ckpt_dir, out_file, "--no-progress"],
        }
        runs: dict[str, list[dict]] = {k: [] for k in cmds}
        out_bytes = None
        for r in range(args.repeats):
            for name, cmd in cmds.items():
                res = run_measured(cmd, os.path.join(workdir, f"{name}_{r}.log"))
                if res["rc"] != 0:
                    with open(os.path.join(workdir, f"{name}_{r}.log")) as f:
                        print(f.read()[-3000:])
                    raise SystemExit(f"{name} failed with exit code {res['rc']}")
                if name == "consolidate":
                    out_bytes = os.path.getsize(out_file)
                    with open(os.path.join(workdir, f"{name}_{r}.log")) as f:
                        res["summary"] = f.read().strip().splitlines()[-1]
                    os.remove(out_file)
                runs[name].append(res)
                print(
                    f"[consolidate_memory] repeat {r} {name:12s} peak RSS {res['maxrss_bytes'] / MiB:7.0f} MiB "
                    f"(polled {res['polled_peak_rss_bytes'] / MiB:.0f}), {res['wall_s']:.1f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    med = {name: statistics.median(r["maxrss_bytes"] for r in rs) for name, rs in runs.items()}
    peak, base, base_cli = med["consolidate"], med["import_only"], med["import_cli"]
    ratios = {
        "peak_over_state": peak / sbytes,
        "net_peak_over_state": (peak - base) / sbytes,
        "net_peak_over_state_cli_imports": (peak - base_cli) / sbytes,
    }
    result = {
        "model_params": cc.n_params(),
        "state_bytes": sbytes,
        "state_tensors": ntensors,
        "consolidated_file_bytes": out_bytes,
        "repeats": args.repeats,
        "runs": runs,
        "median_maxrss_bytes": med,
        "ratios": ratios,
        "machine": cc.machine_note(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"[consolidate_memory] state: {ntensors} tensors, {sbytes / MiB:.0f} MiB; consolidated file "
        f"{(out_bytes or 0) / MiB:.0f} MiB"
    )
    print(f"  peak RSS consolidate  {peak / MiB:7.0f} MiB (median of {args.repeats})")
    print(f"  RSS import fsdp_strategy {base / MiB:7.0f} MiB; with CLI+consolidate imports {base_cli / MiB:.0f} MiB")
    for k, v in ratios.items():
        print(f"  {k:34s} {v:.3f}")
    print(f"[consolidate_memory] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
