"""Checkpoints saved *during* fit by ``ModelCheckpoint``, under DDP and FSDP2, and what a failed save leaves.

Scenarios (``--scenarios``, several per launch; rank 0 writes the results to ``--out``):

- ``during_fit``: each run in ``--runs`` fits 8 steps saving every 2 steps (top 2 by a monitored
  metric, so older ones are removed, plus ``last.ckpt``), then a fresh Trainer resumes from the
  step-6 checkpoint to step 12. Results: the files left, the resumed parameters.
- ``plugin``: DDP and FSDP2 (``state_dict_type="full"``) with a user ``CheckpointIO`` plugin that
  records its calls, alone and wrapped in Lightning's ``AsyncCheckpointIO``: fit with top-k saves,
  ``trainer.test()`` with the same Trainer, a save with ``storage_options``, then a resume through
  the plugin. Results: every rank's calls, the files.
- ``disk_full``: each run in ``--runs`` fits while one rank's disk "fills up" (an injected ``ENOSPC``
  after ``--room`` bytes) from the save at step 4 on; every rank records the error it raised; then a
  fresh Trainer resumes from ``last.ckpt`` without saving.
- ``tmpfs``: the same on the real small filesystem ``--checkpoint-dir``, which rank 0 fills up to
  ``--room`` free bytes at step 4; no fault injected.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

import fsdp_strategy
from testkit.callbacks import RecordingIO
from testkit.faults import Disk
from testkit.models import TinyLM, token_loader


class Module(TinyLM):
    """TinyLM with a metric that grows every step (so top-k keeps the latest) and a test step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("progress", float(self.global_step), sync_dist=True)
        return super().training_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)


def make_strategy(run: str) -> Any:
    if run == "ddp":
        return "ddp"
    kind, _, mode = run.removeprefix("fsdp2_").partition("_")
    return fsdp_strategy.FSDP2Strategy(state_dict_type=kind, async_save=mode == "async")


def make_trainer(run: str, *, max_steps: int, callbacks: list, plugins: list | None = None, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=make_strategy(run),
        max_steps=max_steps,
        limit_val_batches=0,
        limit_test_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=plugins,
        **kwargs,
    )


def checkpointing(directory: Path, *, top_k: int = 2) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=directory, every_n_train_steps=2, save_top_k=top_k, monitor="progress", mode="max", save_last=True
    )


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if any(isinstance(p, DTensor) for p in model.parameters()):
        params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {k: v.float().clone() for k, v in params.items()}


class StartStep(L.Callback):
    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self.step = trainer.global_step


def resume(run: str, ckpt_path: Path, *, max_steps: int, plugins: list | None = None) -> dict:
    L.seed_everything(7)
    start = StartStep()
    trainer = make_trainer(run, max_steps=max_steps, callbacks=[start], plugins=plugins, enable_checkpointing=False)
    model = Module()
    trainer.fit(model, token_loader(), ckpt_path=ckpt_path)
    return {"params": full_params(model), "started_at": start.step, "global_step": trainer.global_step}


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def during_fit(root: Path, runs: list[str]) -> dict:
    results = {}
    for run in runs:
        directory = root / run
        L.seed_everything(42)
        trainer = make_trainer(run, max_steps=8, callbacks=[checkpointing(directory)])
        trainer.fit(Module(), token_loader())
        dist.barrier()
        files = listing(directory)
        step6 = next(name for name in files if "step=6" in name)
        results[run] = {"files": files, **resume(run, directory / step6, max_steps=12)}
    return results


def plugin(root: Path, runs: list[str]) -> dict:
    """Each run with the plugin, then with the plugin wrapped in Lightning's AsyncCheckpointIO (``<run>_async_io``)."""
    results = {}
    for run, name in [(run, f"{run}{suffix}") for suffix in ("", "_async_io") for run in runs]:
        directory = root / f"plugin_{name}"
        recording = RecordingIO()
        io = AsyncCheckpointIO(recording) if name.endswith("_async_io") else recording
        L.seed_everything(42)
        trainer = make_trainer(run, max_steps=8, callbacks=[checkpointing(directory)], plugins=[io])
        model = Module()
        trainer.fit(model, token_loader())
        tested = trainer.test(model, token_loader(), verbose=False)
        trainer.save_checkpoint(directory / "extra.ckpt", storage_options={"tier": "cold"})
        resumed = resume(run, directory / "last.ckpt", max_steps=10, plugins=[io])
        calls: list = [None] * dist.get_world_size()
        dist.all_gather_object(calls, recording.calls)
        files = {file: torch.load(directory / file, weights_only=False) for file in listing(directory)}
        results[name] = {"calls": calls, "files": files, "test": tested, **resumed}
    return results


class AtStep(L.Callback):
    """Runs ``action`` before ModelCheckpoint saves at ``step`` (callbacks run before it)."""

    def __init__(self, step: int, action: Any) -> None:
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            self.action()


def failing_saves(root: Path, runs: list[str], *, room: int, inject: bool, max_steps: int) -> dict:
    """From the save at step 4 on, ``room`` bytes are left. ``inject``: on the disk of one rank (rank 0 for
    full files, which only it writes; the last rank for shards). Otherwise ``root`` is a small real
    filesystem that rank 0 fills up."""
    disk = Disk(root, room=room) if inject else None
    if disk is not None:
        disk.install()
    rank = int(os.environ["RANK"])
    results = {}
    for run in runs:
        directory = root / run
        fault_rank = 0 if "full" in run else int(os.environ["WORLD_SIZE"]) - 1
        action = lambda: disk.arm() if disk is not None else fill_up(root, room)  # noqa: E731
        L.seed_everything(42)
        at_four = AtStep(4, action if rank == fault_rank else lambda: None)
        trainer = make_trainer(run, max_steps=max_steps, callbacks=[at_four, checkpointing(directory, top_k=-1)])
        error: dict | None = None
        try:
            trainer.fit(Module(), token_loader())
        except BaseException as exc:  # recorded: the test checks every rank's error
            error = {"type": type(exc).__name__, "errno": getattr(exc, "errno", None), "message": str(exc)}
            error["is_save_error"] = isinstance(exc, fsdp_strategy.CheckpointSaveError)
        if disk is not None:
            disk.disarm()
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        files = listing(directory)
        results[run] = {"errors": errors, "files": files, **resume(run, directory / "last.ckpt", max_steps=max_steps)}
        if disk is None and rank == 0:  # make room for the next run on the small disk
            shutil.rmtree(directory)
            (root / "filler").unlink()
        dist.barrier()
    return results


def fill_up(root: Path, room: int) -> None:
    """Fills the filesystem of ``root`` until ``room`` bytes are free."""
    free = shutil.disk_usage(root).free
    with open(root / "filler", "wb") as file:
        file.write(b"\0" * max(free - room, 0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", required=True, help="comma-separated: during_fit, plugin, disk_full, tmpfs")
    parser.add_argument("--runs", default="ddp,fsdp2_full_async,fsdp2_sharded_async")
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--room", type=int, default=2000)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    runs = args.runs.split(",")
    results: dict = {}
    for scenario in args.scenarios.split(","):
        if scenario == "during_fit":
            results[scenario] = during_fit(args.checkpoint_dir, runs)
        elif scenario == "plugin":
            results[scenario] = plugin(args.checkpoint_dir, ["ddp", "fsdp2_full"])
        elif scenario == "disk_full":
            results[scenario] = failing_saves(
                args.checkpoint_dir, runs, room=args.room, inject=True, max_steps=args.max_steps
            )
        elif scenario == "tmpfs":
            results[scenario] = failing_saves(
                args.checkpoint_dir, runs, room=args.room, inject=False, max_steps=args.max_steps
            )
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
    if dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
