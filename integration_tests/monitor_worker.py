"""Trains the tiny LM under each given strategy with a ``ShardingMonitor``; every rank writes the
monitor's summary to ``--out-dir/<strategy>_rank<R>.json``, and each run logs to a CSVLogger there."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from fsdp_strategy import ShardingMonitor
from testkit.models import TinyLM, token_loader


def train(strategy: str, devices: int, max_steps: int, out_dir: Path) -> tuple[dict, int]:
    L.seed_everything(42)
    monitor = ShardingMonitor(warmup_steps=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        log_every_n_steps=2,
        limit_val_batches=2,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        logger=CSVLogger(out_dir, name=strategy, version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )
    trainer.fit(TinyLM(), token_loader(), token_loader())
    return monitor.summary, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="fsdp2,ddp")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    for strategy in args.strategies.split(","):
        summary, rank = train(strategy, devices, args.max_steps, args.out_dir)
        (args.out_dir / f"{strategy}_rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
