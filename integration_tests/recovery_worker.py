"""A training run that torchrun may restart: it always resumes from ``ckpt_path="last"``.

On the first attempt only (``TORCHELASTIC_RESTART_COUNT == 0``) one rank can kill itself with SIGKILL:
``--kill-at-step K`` at the start of global step K, ``--kill-in-save K`` when the K-th checkpoint save
begins (rank 0 has staged ``meta.pt`` and is writing its shards; the killed rank has written none);
``--kill-in-publish K`` kills rank 0 in the K-th save after every rank has written its shards, before the
checkpoint gets its name (the rename, or on a URL the manifest). ``--hang-at-step K`` makes it stop at
step K without dying. ``--checkpoint-dir`` may be a URL (``s3://bucket/run``).
Rank 0 of the attempt that finishes writes the final full parameters and timings to ``--out``;
the dying rank writes the moment of its death next to it, for the recovery-time benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.utils.data import DataLoader

import fsdp_strategy
from fsdp_strategy.checkpoint import writing
from testkit.models import TinyLM, token_dataset

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def die(out: Path) -> None:
    out.with_suffix(".killed").write_text(json.dumps({"time": time.time(), "rank": int(os.environ["RANK"])}))
    os.kill(os.getpid(), signal.SIGKILL)


class FailAtStep(L.Callback):
    """Dies (SIGKILL) or hangs (stays alive, never reaches the next collective) at a global step."""

    def __init__(self, step: int, out: Path, *, hang: bool = False) -> None:
        self.step, self.out, self.hang = step, out, hang

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            if self.hang:
                time.sleep(3600)
            die(self.out)


def kill_in_save(k: int, out: Path) -> None:
    save, calls = writing.write_sharded, []

    def save_or_die(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == k:
            die(out)
        return save(*args, **kwargs)

    writing.write_sharded = save_or_die


def kill_in_publish(k: int, out: Path) -> None:
    publish, calls = writing.publish, []

    def publish_or_die(staging, path):  # type: ignore[no-untyped-def]
        calls.append(path)
        if len(calls) == k:
            die(out)
        publish(staging, path)

    writing.publish = publish_or_die


class Timeline(L.Callback):
    """When this attempt started from which step, and when its first step ran."""

    def __init__(self) -> None:
        self.started_at_step: int | None = None
        self.first_batch_time: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self.started_at_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if self.first_batch_time is None:
            self.first_batch_time = time.time()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=30)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--kill-in-save", type=int, default=None)
    parser.add_argument("--kill-in-publish", type=int, default=None)
    parser.add_argument("--hang-at-step", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dying = ATTEMPT == 0 and int(os.environ["RANK"]) == args.kill_rank
    callbacks: list[L.Callback] = [
        # Lightning restarts an epoch from its first batch unless the dataloader is stateful, so only
        # checkpoints at the last batch of an epoch resume exactly with a plain DataLoader.
        ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=4, save_top_k=-1, save_last=True)
    ]
    if dying and args.kill_at_step is not None:
        callbacks.append(FailAtStep(args.kill_at_step, args.out))
    if dying and args.hang_at_step is not None:
        callbacks.append(FailAtStep(args.hang_at_step, args.out, hang=True))
    if dying and args.kill_in_save is not None:
        kill_in_save(args.kill_in_save, args.out)
    if ATTEMPT == 0 and int(os.environ["RANK"]) == 0 and args.kill_in_publish is not None:
        kill_in_publish(args.kill_in_publish, args.out)
    timeline = Timeline()
    callbacks.append(timeline)

    L.seed_everything(42)
    strategy = (
        fsdp_strategy.FSDP2Strategy(timeout=args.timeout, state_dict_type="sharded")
        if args.strategy == "fsdp2"
        else args.strategy
    )
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=int(os.environ["WORLD_SIZE"]) // devices,
        strategy=strategy,
        max_steps=args.max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model = TinyLM()
    loader = DataLoader(token_dataset(32), batch_size=4, shuffle=True)  # 4 steps per epoch on 2 ranks
    trainer.fit(model, loader, ckpt_path="last")

    params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.is_global_zero:
        torch.save(
            {
                "params": {k: v.float() for k, v in params.items()},
                "attempt": ATTEMPT,
                "started_at_step": timeline.started_at_step,
                "first_batch_time": timeline.first_batch_time,
                "global_step": trainer.global_step,
            },
            args.out,
        )


if __name__ == "__main__":
    main()
