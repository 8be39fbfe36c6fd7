"""Trains a tiny Hugging Face Llama under "fsdp2" and saves a sharded checkpoint; rank 0 then writes what
``save_pretrained`` writes for the trained (plain again) model and the module's logits on one batch.

Arguments: ``--checkpoint`` (the sharded checkpoint to write), ``--reference`` (the save_pretrained folder),
``--max-shard-size``, ``--out`` (logits and the batch).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch

import fsdp_strategy
from testkit.hf import TinyLlama
from testkit.models import token_loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--reference", required=True)
    parser.add_argument("--max-shard-size", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    L.seed_everything(7)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=fsdp_strategy.FSDP2Strategy(state_dict_type="sharded"),
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = TinyLlama()
    trainer.fit(module, token_loader(batch_size=4, samples=32))
    trainer.save_checkpoint(args.checkpoint)
    if trainer.is_global_zero:
        module.eval()
        tokens = next(iter(token_loader(batch_size=4, samples=8)))[0]
        with torch.no_grad():
            logits = module(tokens)
        module.model.save_pretrained(args.reference, max_shard_size=args.max_shard_size)
        torch.save({"tokens": tokens, "logits": logits}, args.out)


if __name__ == "__main__":
    main()
