"""The estimator's step peak against the live-tensor peak of real training, on the benchmark GPT (docs/benchmarks.md).

Launches ``testkit.peak_runs`` under torchrun (every configuration, one after another, in the
same processes; with ``--separate`` one launch per configuration), predicts each configuration with ``fsdp_strategy.estimate`` and prints one Markdown row per
configuration: predicted and measured peak (the largest rank) and their difference. Also writes the figures as
JSON to ``--out``.

    python benchmarks/estimate_peak.py --size small --world-size 2 --batch-size 4 --seq-len 128 --out peaks.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fsdp_strategy.estimator.report import estimate
from fsdp_strategy.tools.benchmark.gpt import GPT, GPT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # testkit/, beside the package
from testkit.peak_runs import parse_config  # noqa: E402

MiB = 2**20
CONFIGS = [
    f"{strategy}/{precision}/{checkpointing}"
    for precision in ("32-true", "bf16-mixed")
    for strategy in ("ddp", "fsdp2_grad_op", "fsdp2")
    for checkpointing in ("none", "Block")
]


def predicted(config: str, model_args: dict, world_size: int, batch_size: int, seq_len: int) -> int:
    strategy, precision, checkpointing = parse_config(config)
    report = estimate(
        GPT,
        init_args=model_args,
        world_sizes=[world_size],
        precision=precision,
        strategies=[strategy],
        batch_size=batch_size,
        seq_len=seq_len,
        activation_checkpointing=checkpointing,
    )
    (row,) = report.rows
    return row.checkpointed_peak_bytes if checkpointing else row.step_peak_bytes


def _measure(configs: list[str], model_args: dict, args: argparse.Namespace) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        measured_file = Path(tmp) / "measured.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.world_size}",
            "-m",
            "testkit.peak_runs",
            "--configs",
            ",".join(configs),
            "--model-args",
            json.dumps(model_args),
            "--batch-size",
            str(args.batch_size),
            "--seq-len",
            str(args.seq_len),
            "--out",
            str(measured_file),
        ]
        subprocess.run(
            cmd,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
            stdout=subprocess.DEVNULL,
        )
        return json.loads(measured_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="small", choices=list(GPT_SIZES))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument(
        "--separate",
        action="store_true",
        help="one launch per configuration: a module that stays sharded after fit (too little free"
        " host memory to give it back whole) keeps its tensors alive into the next configuration",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model_args = dict(GPT_SIZES[args.size])
    launches = [[c] for c in args.configs.split(",")] if args.separate else [args.configs.split(",")]
    rows = []
    for configs in launches:  # rows are printed and written after each launch: a long run keeps what it measured
        measured = _measure(configs, model_args, args)
        for config in configs:
            guess = predicted(config, model_args, args.world_size, args.batch_size, args.seq_len)
            actual = max(measured[config])
            rows.append({"config": config, "predicted": guess, "measured": measured[config]})
            strategy, precision, checkpointing = parse_config(config)
            print(
                f"| {args.size} | {args.world_size} | `{strategy}` | {precision} | {'Block' if checkpointing else '-'} |"
                f" {guess / MiB:,.1f} | {actual / MiB:,.1f} | {(guess - actual) / actual:+.2%} |",
                flush=True,
            )
        summary = {**vars(args), "out": str(args.out), "model_args": model_args, "rows": rows}
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
