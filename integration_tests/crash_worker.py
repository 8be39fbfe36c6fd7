"""Trains with a ModelCheckpoint saving every 2 steps; optionally dies in the middle of one save.

``--die-in-save K`` kills rank 0 with SIGKILL during the K-th save, after every rank has written
its shards and before the checkpoint is renamed into place: the worst moment for a crash.
``--resume`` continues from ``ckpt_path="last"``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

import fsdp_strategy
from fsdp_strategy.checkpoint import writing
from testkit.models import TinyLM, token_loader


def die_in_save(k: int) -> None:
    publish, calls = writing.publish, []

    def publish_or_die(staging, path):  # type: ignore[no-untyped-def]
        calls.append(path)
        if len(calls) == k:
            os.kill(os.getpid(), signal.SIGKILL)
        publish(staging, path)

    writing.publish = publish_or_die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--die-in-save", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.die_in_save:
        die_in_save(args.die_in_save)

    L.seed_everything(42)
    checkpoints = ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=fsdp_strategy.FSDP2Strategy(state_dict_type="sharded"),
        max_steps=8,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
    )
    model = TinyLM()
    steps_at_start = []
    model.on_train_start = lambda: steps_at_start.append(trainer.global_step)  # type: ignore[method-assign]
    trainer.fit(model, token_loader(), ckpt_path="last" if args.resume else None)
    if trainer.is_global_zero:
        with open(args.out, "w") as file:
            json.dump({"global_step": trainer.global_step, "started_at": steps_at_start[0]}, file)


if __name__ == "__main__":
    main()
