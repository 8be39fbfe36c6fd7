"""The ``fsdp-strategy`` command (also ``python -m fsdp_strategy``)."""

from __future__ import annotations

import argparse
import platform
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-strategy", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("env", help="versions, devices and the registered strategy names").set_defaults(run=_env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
