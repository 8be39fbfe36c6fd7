"""One training run, launched by torchrun or by Lightning's own launcher (``--devices N``).

Rank 0 writes the final full parameters, per-step losses and per-rank model-state bytes to
``--out``, so that tests can compare a sharded run with a DDP reference run.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

import fsdp_strategy
from fsdp_strategy.sharding.state_bytes import model_state_bytes
from testkit.collectives import CountCollectives
from testkit.models import TinyGAN, TinyLM, token_loader, uneven_lm


class Recorder(L.Callback):
    """Per-step losses, and each rank's model state at the end of training, while the module is sharded."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.state_bytes: tuple[int, int] | None = None
        self.comm_buffer_bytes: int | None = None  # the strategy lets its pool go with the stage

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if isinstance(outputs, dict) and "loss" in outputs:
            self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        self.state_bytes = (
            model_state_bytes(pl_module, optimizers, scalar_state=False),  # as padded_share_bytes counts
            padded_share_bytes(pl_module, optimizers, trainer.world_size),
        )
        self.comm_buffer_bytes = getattr(
            getattr(getattr(trainer.strategy, "sharding", None), "comm_buffers", None), "nbytes", None
        )


def padded_share_bytes(module: torch.nn.Module, optimizers: list, world_size: int) -> int:
    """1/N of the full model state, with each tensor's first dimension padded to a multiple of N."""
    total = 0
    for p in {id(p): p for p in module.parameters()}.values():
        shape = p.shape
        share = math.ceil(shape[0] / world_size) * (p.numel() // shape[0] if shape[0] else 0)
        copies = (
            1
            + (p.grad is not None)
            + sum(1 for opt in optimizers for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0)
        )
        total += share * p.element_size() * copies
    return total


# Each variant is one training configuration; a launch runs several of them under each strategy
# in the same process group, which saves the start-up cost of a launch per configuration.
VARIANTS: dict[str, dict] = {
    "adamw": {},
    "adamw_clip_norm": {"clip_val": 0.5},
    "adamw_clip_value_ac": {"clip_val": 0.05, "clip_algorithm": "value", "activation_checkpointing": True},
    "sgd": {"optimizer": "sgd"},
    "sgd_accumulate": {"optimizer": "sgd", "accumulate": 2},
    "sgd_accumulate_clip_norm": {"optimizer": "sgd", "accumulate": 2, "clip_val": 0.5},
    # counts the collectives of each step (testkit.collectives: a dispatch mode over the whole fit)
    "sgd_accumulate4": {"optimizer": "sgd", "accumulate": 4, "count_collectives": True},
    "sgd_bf16": {"optimizer": "sgd", "precision": "bf16-mixed"},
    "sgd_bf16_ac": {"optimizer": "sgd", "precision": "bf16-mixed", "activation_checkpointing": True},
    "gan": {"model": "gan"},
    "empty_init": {"empty_init": True},
    "adamw_scheduler": {"scheduler": True},
    # Parameters whose first dimension 2 and 4 ranks do not divide (testkit.models.UNEVEN): FSDP2 pads the last shards.
    "uneven_adamw": {"model": "uneven"},
    "uneven_sgd_accumulate_clip_norm": {"model": "uneven", "optimizer": "sgd", "accumulate": 2, "clip_val": 0.5},
    "uneven_adamw_clip_value_ac": {
        "model": "uneven",
        "clip_val": 0.05,
        "clip_algorithm": "value",
        "activation_checkpointing": True,
    },
}


def make_strategy(name: str, variant: dict, checkpoint_dir: Path | None = None) -> str | L.pytorch.strategies.Strategy:
    if name == "ddp" and variant.get("model") == "gan":
        return "ddp_find_unused_parameters_true"  # the discriminator step leaves the generator unused
    if name == "fsdp2_initw":  # start from the weights of the DDP run's checkpoint
        return fsdp_strategy.FSDP2Strategy(init_weights=str(checkpoint_dir / "ddp.ckpt"))
    if name == "ddp_initw":
        return "ddp"
    if name == "fsdp2_full":
        return fsdp_strategy.FSDP2Strategy(state_dict_type="full")
    if name == "fsdp2_async":
        return fsdp_strategy.FSDP2Strategy(async_save=True, state_dict_type="sharded")
    if name == "fsdp2" and checkpoint_dir is not None:  # the checkpoint tests read a sharded directory
        return fsdp_strategy.FSDP2Strategy(state_dict_type="sharded")
    if name == "fsdp2_fresh_buffers":  # FSDP2's own allocation of its collectives' buffers
        return fsdp_strategy.FSDP2Strategy(reuse_comm_buffers=False, activation_checkpointing_policy=_ac(variant))
    if name == "fsdp2_compiled":
        return fsdp_strategy.FSDP2Strategy(compile_blocks="aot_eager")
    if name == "fsdp2_replicate2":
        return fsdp_strategy.FSDP2Strategy(replicate_size=2, activation_checkpointing_policy=_ac(variant))
    if name == "fsdp2_replicate2_sync":  # reduce-scatter every micro-batch, all-reduce across replicas once
        return fsdp_strategy.FSDP2Strategy(replicate_size=2, sync_grads_each_micro_batch=True)
    if name.startswith("fsdp2") and variant.get("activation_checkpointing"):
        return fsdp_strategy.FSDP2Strategy(
            activation_checkpointing_policy="auto", reshard_after_forward=name != "fsdp2_grad_op"
        )
    return name


def _ac(variant: dict) -> str | None:
    return "auto" if variant.get("activation_checkpointing") else None


def train(run: str, variant: dict, devices: int, max_steps: int, checkpoint_dir: Path | None) -> dict:
    """``run`` is a strategy name, or ``name:source`` to resume from the checkpoint that the run
    ``source`` saved in ``checkpoint_dir`` and train as many steps again."""
    strategy_name, _, source = run.partition(":")
    ckpt_path = checkpoint_dir / f"{source}.ckpt" if source and checkpoint_dir else None
    if ckpt_path is not None:
        max_steps *= 2
    L.seed_everything(42)
    accumulate = variant.get("accumulate", 1)
    recorder = Recorder()
    collectives = CountCollectives()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=make_strategy(strategy_name, variant, checkpoint_dir),
        precision=variant.get("precision", "32-true"),
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=variant.get("clip_val"),
        gradient_clip_algorithm=variant.get("clip_algorithm", "norm") if variant.get("clip_val") else None,
        limit_val_batches=2,
        val_check_interval=max_steps * accumulate,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, collectives] if variant.get("count_collectives") else [recorder],
    )
    with trainer.init_module(empty_init=variant.get("empty_init", False)):
        if variant.get("model") == "gan":
            model = TinyGAN()
        elif variant.get("model") == "uneven":
            model = uneven_lm(optimizer=variant.get("optimizer", "adamw"))
        else:
            model = TinyLM(optimizer=variant.get("optimizer", "adamw"), scheduler=variant.get("scheduler", False))
    if strategy_name == "ddp_initw":
        model.load_state_dict(torch.load(checkpoint_dir / "ddp.ckpt", weights_only=False)["state_dict"])
    trainer.fit(model, token_loader(), token_loader(), ckpt_path=ckpt_path)
    if checkpoint_dir is not None and ckpt_path is None and not strategy_name.endswith("_initw"):
        trainer.save_checkpoint(checkpoint_dir / f"{strategy_name}.ckpt")
        trainer.strategy.barrier()

    per_rank: list = [None] * trainer.world_size
    dist.all_gather_object(per_rank, recorder.state_bytes)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {
        "params": {k: v.float() for k, v in params.items()},
        "losses": recorder.losses,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "state_bytes": per_rank,
        "world_size": trainer.world_size,
        "is_global_zero": trainer.is_global_zero,
        # bytes of the collectives' buffers that the strategy reused (None: FSDP2's own allocation)
        "comm_buffer_bytes": recorder.comm_buffer_bytes,
        "collectives_per_step": collectives.over_mesh(getattr(trainer.strategy, "device_mesh", None)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="fsdp2,ddp", help="comma-separated Trainer strategy names")
    parser.add_argument("--variants", default="adamw", help=f"comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--devices", type=int, default=None, help="use Lightning's launcher with this many processes")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="save (name) / resume (name:source) here")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    results, is_global_zero = {}, False
    for variant in args.variants.split(","):
        for strategy in args.strategies.split(","):
            result = train(strategy, VARIANTS[variant], devices, args.max_steps, args.checkpoint_dir)
            is_global_zero = result.pop("is_global_zero")
            results[f"{strategy}/{variant}"] = result
    if is_global_zero:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
