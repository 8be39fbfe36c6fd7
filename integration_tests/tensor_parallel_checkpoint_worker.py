"""A checkpoint moved between layouts on 4 gloo ranks: the GPT of ``testkit.tensor_parallel`` trained on 2 data x 2
tensor ranks (``tensor_parallel_size=2``, split and sharded in ``configure_model``), plain on 4 data ranks (1-D
``fsdp2``), or plain under ``strategy="ddp"`` (Lightning's single ``.ckpt`` file), each resumable in another layout.

``--layout`` ``2x2``, ``4x1`` or ``ddp``; ``--steps`` the step to train to; ``--resume`` a checkpoint to resume
from; ``--save`` where to save a checkpoint (sharded under ``fsdp2``) after step 2, where
``ModelCheckpoint(every_n_train_steps=2)`` saves, while training goes on uninterrupted to ``--steps``. Every layout reads the same global batches of 8 samples (4 per
data-parallel rank at 2x2, 2 at 4x1 and ddp), two per epoch. Rank 0 writes to ``--out`` the full parameters at
the first step, at the save and at the end, and AdamW's step counts.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import fsdp_strategy
from testkit.models import token_dataset
from testkit.tensor_parallel import TensorParallelGPT

GLOBAL_BATCH = 8
STEPS_PER_EPOCH = 2


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


class ParamsAtStart(L.Callback):
    """The parameters the first step starts from: a resumed checkpoint's, in this layout."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = full_params(pl_module)


class SaveAtStepTwo(L.Callback):
    """Saves where ``ModelCheckpoint(every_n_train_steps=2)`` does, and keeps the parameters saved. (Not in
    ``on_train_epoch_end``: Lightning resumes a checkpoint saved there, before it counts the epoch done, one
    shuffled batch off, under DDP too.)"""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.params: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: object) -> None:
        if self.path and trainer.global_step == 2:
            trainer.save_checkpoint(self.path)
            self.params = full_params(pl_module)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["2x2", "4x1", "ddp"], required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tensor = 2 if args.layout == "2x2" else 1
    if args.layout == "ddp":
        strategy = "ddp"
    else:
        strategy = fsdp_strategy.FSDP2Strategy(tensor_parallel_size=tensor, state_dict_type="sharded")
    L.seed_everything(42)
    model = TensorParallelGPT("tp_fsdp" if tensor == 2 else "none")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[at_start := ParamsAtStart(), saved := SaveAtStepTwo(args.save)],
    )
    per_rank = GLOBAL_BATCH // (4 // tensor)
    loader = DataLoader(token_dataset(STEPS_PER_EPOCH * GLOBAL_BATCH), batch_size=per_rank)
    trainer.fit(model, loader, ckpt_path=args.resume)
    params = full_params(model)
    # AdamW's own step count: 4 after resuming a checkpoint of step 2 only if its state was loaded.
    adam_steps = {float(state["step"]) for state in trainer.optimizers[0].state.values()}
    if dist.get_rank() == 0:
        result = {"params": params, "at_start": at_start.params, "saved": saved.params, "adam_steps": adam_steps}
        torch.save({**result, "global_step": trainer.global_step}, args.out)


if __name__ == "__main__":
    main()
