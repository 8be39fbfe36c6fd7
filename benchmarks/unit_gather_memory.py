"""Host memory of one FSDP2 all-gather on CPU (gloo): what gathering a unit costs over its shards.

    OMP_NUM_THREADS=1 python benchmarks/unit_gather_memory.py [--ranks 2,4] [--rows 32000] [--columns 2048]

For each number of ranks, ``torch.distributed.run`` runs this file with ``--gather``: one ``nn.Embedding(rows,
columns)`` in fp32 (250 MiB at the defaults: a Llama's embedding), sharded by ``fully_shard`` over the ranks, then
``unshard()`` and ``reshard()`` twice (the first creates FSDP2's gathered parameter, later ones reuse it). Before each
call freed heap memory is handed back (``malloc_trim``) and the peak RSS reset (``/proc/self/clear_refs``); reported
per call: the peak RSS growth during it and the RSS growth it leaves, over the RSS before the first call, in MiB and
in units of the gathered parameter's size. Rank 0's figures; the others measure alike.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pretrained_load_memory import run_ranks  # this folder is the script's own: on sys.path

MiB = 2**20


def gather(rows: int, columns: int, out: str) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from fsdp_strategy import host_memory
    from fsdp_strategy.monitor.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from fsdp_strategy.sharding.mesh import build_device_mesh

    dist.init_process_group("gloo")
    model = nn.Sequential(nn.Embedding(rows, columns))
    fully_shard(model[0], mesh=build_device_mesh("cpu", 1, dist.get_world_size()))
    full = model[0].weight.numel() * model[0].weight.element_size()
    host_memory.release()
    start = current_rss_bytes()
    measured = []
    for call in (model[0].unshard, model[0].reshard, model[0].unshard, model[0].reshard):
        host_memory.release()
        dist.barrier()
        reset_peak_rss()
        call()
        peak, after = max(peak_rss_bytes(), current_rss_bytes()), current_rss_bytes()
        measured.append({"call": call.__name__, "peak": peak - start, "after": after - start})
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"full": full, "calls": measured}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--rows", type=int, default=32000)
    parser.add_argument("--columns", type=int, default=2048)
    parser.add_argument("--gather", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.gather:
        return gather(args.rows, args.columns, args.out)
    print("| ranks | call | peak RSS growth during it | RSS growth after it | peak / gathered size |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            arguments = ["--gather", "--rows", str(args.rows), "--columns", str(args.columns)]
            result = run_ranks(__file__, ranks, arguments, Path(tmp) / "out.json")
            for index, call in enumerate(result["calls"]):
                print(
                    f"| {ranks} | {index // 2 + 1}. {call['call']}() | {call['peak'] / MiB:.0f} MiB"
                    f" | {call['after'] / MiB:.0f} MiB | {call['peak'] / result['full']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
