"""Training runs in which one rank's gradient turns non-finite at one step (``nonfinite_grads``).

``--run`` names the configuration: ``fsdp2_skip`` / ``fsdp2_raise`` poison the loss on the last rank at
``--poison-step``; ``ddp_drop`` is the reference that knows nothing of the guard: DDP, no poison, and a
callback that drops every gradient at that step. Rank 0 writes the final full parameters and each
rank's count of skipped steps to ``--out``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

import fsdp_strategy
from testkit.callbacks import DropGradsAt
from testkit.models import PoisonedLM, token_loader


def train(run: str, devices: int, poison_step: int, max_steps: int) -> dict:
    L.seed_everything(42)
    if run == "ddp_drop":
        strategy, callbacks, poison = "ddp", [DropGradsAt(poison_step)], None
    else:
        strategy = fsdp_strategy.FSDP2Strategy(nonfinite_grads=run.removeprefix("fsdp2_"))
        callbacks, poison = [], poison_step
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model = PoisonedLM(poison, poison_rank=devices - 1 if poison is not None else None)
    trainer.fit(model, token_loader())
    skipped: list = [None] * trainer.world_size
    dist.all_gather_object(skipped, getattr(trainer.strategy, "skipped_steps", None))
    if any(isinstance(p, DTensor) for p in model.parameters()):
        params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {"params": params, "skipped_steps": skipped}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--runs", default="fsdp2_skip,ddp_drop", help="comma-separated: fsdp2_skip, fsdp2_raise, ddp_drop"
    )
    parser.add_argument("--devices", type=int, default=None, help="processes in the job (default: torchrun's)")
    parser.add_argument("--poison-step", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    results = {run: train(run, devices, args.poison_step, args.max_steps) for run in args.runs.split(",")}
    if args.out and dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
