"""Peak memory of ``fsdp-strategy consolidate --format safetensors`` relative to the largest tensor.

    OMP_NUM_THREADS=1 python benchmarks/export_memory.py [--repeats 3] [--ranks 1,2] [--tmp /tmp]

1. For each number of ranks, ``torch.distributed.run`` runs this file with ``--create DIR``: a model whose largest
   tensor is a 65536 x 1024 fp32 embedding (256 MiB), plus four 1024 x 1024 linears (4 MiB each), sharded with
   ``fully_shard`` over the ranks and saved as a sharded checkpoint (``fsdp_strategy.checkpoint.writing.save_sharded``, meta.pt included).
   With 1 rank each tensor is one block (the worst case for the export); with 2 ranks two row blocks.
2. Interleaved, ``--repeats`` times: (a) a process that imports what the command imports, (b) the command, OUT
   deleted after each run. Peak RSS is each child's ``ru_maxrss`` (``os.wait4``).
Reported: ``(peak of b - peak of a) / largest tensor bytes``, median (min, max) over repeats; the target is <= 1.3.
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
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
IMPORTS = "import fsdp_strategy.tools.cli, fsdp_strategy.tools.export, fsdp_strategy.tools.consolidate, safetensors, huggingface_hub"


def create(directory: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from fsdp_strategy.checkpoint import writing
    from fsdp_strategy.launch import rendezvous
    from fsdp_strategy.sharding.mesh import build_device_mesh

    dist.init_process_group("gloo")
    rendezvous.finish_collectives_at_exit()  # gloo threads finish before Python does (docs/gloo_exit_abort.py)
    mesh = build_device_mesh("cpu", 1, dist.get_world_size())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(65536, 1024), *[nn.Linear(1024, 1024) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {"state_dict": get_model_state_dict(model), "optimizer_states": [], "hyper_parameters": {}}
    writing.save_sharded(directory, state, is_rank_zero=dist.get_rank() == 0)
    dist.destroy_process_group()


def peak(cmd: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--create")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--tmp", default=None)
    args = parser.parse_args()
    if args.create:
        create(args.create)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    largest = 65536 * 1024 * 4
    results = {}
    root = tempfile.mkdtemp(dir=args.tmp)
    try:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            directory, out = os.path.join(root, f"ckpt{ranks}"), os.path.join(root, "out")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={ranks}",
                    __file__,
                    "--create",
                    directory,
                ],
                cwd=REPO,
                env=env,
                check=True,
                capture_output=True,
            )
            ratios, seconds = [], []
            for _ in range(args.repeats):
                baseline, _ = peak([sys.executable, "-c", IMPORTS])
                exported, wall = peak(
                    [
                        sys.executable,
                        "-m",
                        "fsdp_strategy",
                        "consolidate",
                        directory,
                        out,
                        "--format",
                        "safetensors",
                        "--no-progress",
                    ]
                )
                shutil.rmtree(out, ignore_errors=True)
                ratios.append((exported - baseline) / largest)
                seconds.append(wall)
                print(
                    f"ranks={ranks}: import peak {baseline / MiB:.0f} MiB, export peak {exported / MiB:.0f} MiB,"
                    f" growth {(exported - baseline) / MiB:.0f} MiB = {ratios[-1]:.3f} x largest tensor, {wall:.1f} s",
                    flush=True,
                )
            results[ranks] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "seconds": statistics.median(seconds),
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
