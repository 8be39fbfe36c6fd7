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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

import fsdp_strategy
from integration_tests.models import TinyLM, token_loader


class PoisonedLM(TinyLM):
    """``TinyLM`` whose loss holds inf on ``poison_rank`` at ``poison_step`` (every rank when ``None``).

    The inf enters through one element of the module's own ``scale`` parameter, so only that
    element's gradient is infinite; sharded over 2 ranks it lies in rank 1's shard alone.
    """

    def __init__(self, poison_step: int | None, poison_rank: int | None = None, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.poison_step, self.poison_rank = poison_step, poison_rank

    def poisoned(self, loss: torch.Tensor) -> torch.Tensor:
        if self.global_step == self.poison_step and self.poison_rank in (None, self.global_rank):
            return loss + self.scale[-4] * float("inf")
        return loss

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.poisoned(super().training_step(batch, batch_idx))


class DropGradsAt(L.Callback):
    """Drops every gradient before the optimizer step at ``step``: a skipped step made without the guard."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            for param in pl_module.parameters():
                param.grad = None


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
    parser.add_argument("--runs", default="fsdp2_skip,ddp_drop", help="comma-separated: fsdp2_skip, fsdp2_raise, ddp_drop")
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
