"""Trains a tiny Hugging Face Llama under "fsdp2" and saves a sharded checkpoint; rank 0 then writes what
``save_pretrained`` writes for the trained (plain again) model and the module's logits on one batch.

Arguments: ``--checkpoint`` (the sharded checkpoint to write), ``--reference`` (the save_pretrained folder; only
without tensor parallelism, where the module is plain again after training), ``--max-shard-size``,
``--tensor-parallel-size`` (1: a 1-D mesh; 2 on 4 ranks: 2 data x 2 tensor, the Llama split by its
``base_model_tp_plan``), ``--out`` (the batch, the logits of the trained module on it, the trained Llama's
full state dict and the names of its parameters split over two mesh dimensions). Every layout trains on the same global batches of 16 samples.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch.distributed.tensor import DTensor

import fsdp_strategy
from testkit.hf import TinyLlama
from testkit.models import token_loader

GLOBAL_BATCH = 16


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one plain tensor: a DTensor is gathered, which every rank must call together."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--reference")
    parser.add_argument("--max-shard-size", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    L.seed_everything(7)
    world_size = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=fsdp_strategy.FSDP2Strategy(state_dict_type="sharded", tensor_parallel_size=args.tensor_parallel_size),
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = TinyLlama()
    data_parallel_ranks = world_size // args.tensor_parallel_size
    trainer.fit(module, token_loader(batch_size=GLOBAL_BATCH // data_parallel_ranks, samples=32))
    trainer.save_checkpoint(args.checkpoint)
    # Under tensor parallelism the module stays sharded: every rank runs the forward and gathers, together.
    module.eval()
    tokens = next(iter(token_loader(batch_size=4, samples=8)))[0]
    with torch.no_grad():
        logits = whole(module(tokens))
    state = {name: whole(value).detach().clone() for name, value in module.model.state_dict().items()}
    # Split by the plan: sharded over both dimensions of the (data_parallel, tensor_parallel) mesh.
    split = sorted(
        name for name, p in module.model.named_parameters() if isinstance(p, DTensor) and p.device_mesh.ndim == 2
    )
    if trainer.is_global_zero:
        if args.reference is not None:
            module.model.save_pretrained(args.reference, max_shard_size=args.max_shard_size)
        torch.save({"tokens": tokens, "logits": logits, "state": state, "split": split}, args.out)


if __name__ == "__main__":
    main()
