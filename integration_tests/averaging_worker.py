"""Lightning's ``WeightAveraging`` callbacks under DDP and FSDP2, in one launch (rank 0 writes ``--out``).

For each run in ``--runs`` (``ddp``, ``fsdp2`` with sharded checkpoints, ``fsdp2_full`` with single files):

- ``ema``: ``EMAWeightAveraging(decay=0.8)`` (counting the collectives it runs) on ``TinyLM`` (tied weights, sharded blocks), 8 steps with a
  validation every 4 steps (the average is swapped in) and a checkpoint at steps 4 and 8; then a fresh
  Trainer resumes from the step-4 checkpoint to step 8. ``ddp>fsdp2`` resumes DDP's file under FSDP2.
  Results: the module after fit (the average, copied in at the end), the average as it was at every step
  and its layout, the validation losses, and the same after the resume.
- ``swa``: ``WeightAveraging()`` (an equal average of every step's weights) on ``TinyCNN``, whose
  BatchNorm buffers are averaged too.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import (
    EMAWeightAveraging,
    ModelCheckpoint,
    WeightAveraging,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_strategy
from fsdp_strategy._compat import averaged_model_of
from testkit.dropin import TinyCNN, image_loader
from testkit.models import TinyLM, token_loader


def make_strategy(run: str) -> Any:
    if run == "ddp":
        return "ddp"
    return fsdp_strategy.FSDP2Strategy(state_dict_type="full" if run == "fsdp2_full" else "sharded")


def make_trainer(run: str, callbacks: list, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=make_strategy(run),
        max_steps=8,
        val_check_interval=4,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().cpu().clone()


class Record(L.Callback):
    """After each step (after the callbacks before it updated the average): the average and its layout;
    after each validation: the validation loss."""

    def __init__(self, averaging: WeightAveraging) -> None:
        self.averaging = averaging
        self.averages: list[dict[str, torch.Tensor]] = []
        self.layout: dict[str, Any] = {}
        self.val_losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        average = averaged_model_of(self.averaging).module
        self.averages.append({name: full(p) for name, p in average.named_parameters()})
        model = dict(pl_module.named_parameters())
        self.layout = {
            name: {
                "dtensor": isinstance(p, DTensor),
                "same_placements": isinstance(p, DTensor) and p.placements == model[name].placements,
                "local_numel": (p.to_local() if isinstance(p, DTensor) else p).numel(),
                "numel": p.numel(),
            }
            for name, p in average.named_parameters()
        }

    def on_validation_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        if not trainer.sanity_checking:
            self.val_losses.append(trainer.callback_metrics["val_loss"].item())


class CountedEMA(EMAWeightAveraging):
    """Counts the collectives run while the average is updated, and swapped in and out for validation."""

    def __init__(self) -> None:
        super().__init__(decay=0.8)
        self.collectives = 0

    def on_train_batch_end(self, *args: Any) -> None:
        with CommDebugMode() as comm:
            super().on_train_batch_end(*args)
        self.collectives += comm.get_total_counts()

    def on_validation_epoch_start(self, *args: Any) -> None:
        with CommDebugMode() as comm:
            super().on_validation_epoch_start(*args)
        self.collectives += comm.get_total_counts()

    def on_validation_epoch_end(self, *args: Any) -> None:
        with CommDebugMode() as comm:
            super().on_validation_epoch_end(*args)
        self.collectives += comm.get_total_counts()


def module_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in model.named_parameters()}


def fit(
    run: str,
    model_class: type,
    averaging: WeightAveraging,
    loader: Any,
    *,
    directory: Path | None,
    ckpt_path: Path | None = None,
) -> dict:
    record = Record(averaging)
    callbacks: list = [averaging, record]
    if directory is not None:
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=4, save_top_k=-1, filename="{step}"))
    trainer = make_trainer(run, callbacks, enable_checkpointing=directory is not None)
    L.seed_everything(42)
    model = model_class()
    trainer.fit(model, loader, loader, ckpt_path=ckpt_path)
    return {
        "params": module_params(model),
        "averages": record.averages,
        "layout": record.layout,
        "val_losses": record.val_losses,
        "collectives": averaging.collectives if isinstance(averaging, CountedEMA) else None,
    }


def ema(root: Path, runs: list[str]) -> dict:
    results = {}
    for run in runs:
        source, _, target = run.rpartition(">")
        if not source:
            results[run] = fit(run, TinyLM, CountedEMA(), token_loader(), directory=root / run)
            dist.barrier()
            source, target = run, run
        # A fresh Trainer resumes the step-4 checkpoint (the run's own, or another strategy's) to step 8.
        step4 = root / source / "step=4.ckpt"
        results[f"{source}>{target}"] = fit(
            target, TinyLM, CountedEMA(), token_loader(), directory=None, ckpt_path=step4
        )
    return results


def swa(runs: list[str]) -> dict:
    loader = image_loader(rank=int(os.environ["RANK"]), batch_size=4, batches=8)
    return {run: fit(run, TinyCNN, WeightAveraging(), loader, directory=None) for run in runs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", default="ema,swa")
    parser.add_argument("--runs", default="ddp,fsdp2,fsdp2_full,ddp>fsdp2")
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = args.runs.split(",")
    results: dict[str, Any] = {}
    for scenario in args.scenarios.split(","):
        if scenario == "ema":
            results["ema"] = ema(args.checkpoint_dir, runs)
        elif scenario == "swa":
            results["swa"] = swa([run for run in runs if ">" not in run])
    if dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
