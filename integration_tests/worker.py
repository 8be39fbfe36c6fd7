"""One training run, launched by torchrun or by Lightning's own launcher (``--devices N``).

Rank 0 writes the final full parameters, per-step losses and per-rank model-state bytes to
``--out``, so that tests can compare a sharded run with a DDP reference run.
"""

from __future__ import annotations

import argparse
import math
import os

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

import fsdp_strategy
from integration_tests.models import TinyGAN, TinyLM, token_loader


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if outputs is not None:
            self.losses.append(float(outputs["loss"]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def model_state_bytes(module: torch.nn.Module, optimizers: list) -> int:
    """Bytes this rank holds of parameters, gradients and optimizer state."""
    params = list({id(p): p for p in module.parameters()}.values())
    total = sum(_local(p).numel() * p.element_size() for p in params)
    total += sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)
    for opt in optimizers:
        for state in opt.state.values():
            total += sum(_local(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def padded_share_bytes(module: torch.nn.Module, optimizers: list, world_size: int) -> int:
    """1/N of the full model state, with each tensor's first dimension padded to a multiple of N."""
    total = 0
    for p in {id(p): p for p in module.parameters()}.values():
        shape = p.shape
        share = math.ceil(shape[0] / world_size) * (p.numel() // shape[0] if shape[0] else 0)
        copies = 1 + (p.grad is not None) + sum(
            1 for opt in optimizers for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0
        )
        total += share * p.element_size() * copies
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--model", default="lm", choices=["lm", "gan"])
    parser.add_argument("--devices", type=int, default=None, help="use Lightning's launcher with this many processes")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip-val", type=float, default=None)
    parser.add_argument("--clip-algorithm", default="norm")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--empty-init", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    L.seed_everything(42)
    if args.strategy.startswith("fsdp2") and args.activation_checkpointing:
        strategy = fsdp_strategy.FSDP2Strategy(activation_checkpointing_policy="auto")
    else:
        strategy = args.strategy
    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip_val,
        gradient_clip_algorithm=args.clip_algorithm if args.clip_val else None,
        limit_val_batches=2,
        val_check_interval=args.max_steps * args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    with trainer.init_module(empty_init=args.empty_init):
        model = TinyLM(optimizer=args.optimizer) if args.model == "lm" else TinyGAN()
    trainer.fit(model, token_loader(), token_loader())

    optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
    state_bytes = model_state_bytes(model, optimizers)
    share = padded_share_bytes(model, optimizers, trainer.world_size)
    per_rank = [None] * trainer.world_size
    dist.all_gather_object(per_rank, (state_bytes, share))
    if isinstance(model.head if args.model == "lm" else model.generator[0], DTensor) or any(
        isinstance(p, DTensor) for p in model.parameters()
    ):
        params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if trainer.is_global_zero:
        torch.save(
            {
                "params": {k: v.float() for k, v in params.items()},
                "losses": recorder.losses,
                "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                "state_bytes": per_rank,
                "world_size": trainer.world_size,
            },
            args.out,
        )


if __name__ == "__main__":
    main()
