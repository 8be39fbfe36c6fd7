"""The ``fsdp-strategy`` command (also ``python -m fsdp_strategy``)."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _env(_: argparse.Namespace) -> int:
    import lightning
    import torch
    from lightning.pytorch.strategies import StrategyRegistry

    import fsdp_strategy

    names = sorted(name for name, entry in StrategyRegistry.items() if entry["strategy"] is fsdp_strategy.FSDP2Strategy)
    print(f"fsdp-strategy {fsdp_strategy.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}")
    print(f"CUDA devices: {torch.cuda.device_count()}")
    print(f"strategy names: {', '.join(names)}")
    print(f"precisions: {', '.join(fsdp_strategy.SUPPORTED_PRECISIONS)}")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from fsdp_strategy.consolidate import _consolidate as consolidate

    try:
        summary = consolidate(args.checkpoint_dir, args.output_file, overwrite=args.overwrite, progress=args.progress)
    except (OSError, ValueError) as exc:  # a missing, foreign or damaged checkpoint; an existing output; disk full
        message = " ".join(str(exc).split())
        print(f"fsdp-strategy consolidate: error: {message}", file=sys.stderr)
        return 2
    print(summary.describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-strategy", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("env", help="versions, devices and the registered strategy names").set_defaults(run=_env)
    consolidate = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint directory as one ordinary Lightning checkpoint file",
        description="Reads a sharded checkpoint directory (saved by FSDP2Strategy) in one process, tensor by tensor,"
        " and writes one Lightning checkpoint file that loads with any strategy or none.",
    )
    consolidate.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="the sharded checkpoint directory")
    consolidate.add_argument("output_file", metavar="OUT_FILE", help="the checkpoint file to write")
    consolidate.add_argument("--overwrite", action="store_true", help="replace OUT_FILE if it exists")
    consolidate.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    consolidate.set_defaults(run=_consolidate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
