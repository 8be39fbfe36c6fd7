"""Checkpoint size of a LoRA run: an adapter checkpoint (``state_dict_type="adapter"``) against a sharded one.

Run with two CPU ranks:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/adapter_checkpoint_size.py

A Hugging Face Llama built from a config (``--hidden``, ``--layers``, ``--vocab``; no download) with peft's LoRA
adapters of rank ``--rank`` on the attention projections (``--targets``), trained ``--steps`` steps with AdamW over
the trainable parameters under ``FSDP2Strategy``, once per format from the same seed; each run saves one checkpoint
with ``trainer.save_checkpoint`` into a temporary folder. Rank 0 prints the bytes on disk of each (every file of
the directory), their ratio, the parameters trainable and frozen, and writes benchmarks/results/
adapter_checkpoint_size.json. The PEFT export of the adapter checkpoint (``consolidate --format peft``) is timed
and sized too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import fsdp_strategy

HERE = Path(__file__).resolve().parent


class LoraLlama(L.LightningModule):
    def __init__(self, hidden: int, layers: int, vocab: int, rank: int, targets: list[str]) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 8 // 3,
            num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64),
            max_position_embeddings=256,
        )
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets)
        self.model = get_peft_model(LlamaForCausalLM(config), lora)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def bytes_on_disk(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=8, help="LoRA's rank (default: 8)")
    parser.add_argument("--targets", default="q_proj,v_proj", help="LoRA's target modules (default: q_proj,v_proj)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tmp", default=None, help="parent of the temporary folder (default: $TMPDIR or /tmp)")
    parser.add_argument("--out", default=str(HERE / "results" / "adapter_checkpoint_size.json"))
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    root = Path(tempfile.mkdtemp(prefix="adapter-size-", dir=args.tmp)) if rank == 0 else None
    dist.init_process_group("gloo")
    shared = [str(root)]
    dist.broadcast_object_list(shared)
    root = Path(shared[0])

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (2 * world * args.steps, 64), generator=generator)
    data = DataLoader(TensorDataset(tokens), batch_size=2)
    sizes, counts = {}, {}
    for kind in ("sharded", "adapter"):
        L.seed_everything(0)
        module = LoraLlama(args.hidden, args.layers, args.vocab, args.rank, args.targets.split(","))
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=fsdp_strategy.FSDP2Strategy(state_dict_type=kind),
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(module, data)
        trainer.save_checkpoint(root / f"{kind}.ckpt")
        sizes[kind] = bytes_on_disk(root / f"{kind}.ckpt")
        counts = {
            "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "frozen": sum(p.numel() for p in module.parameters() if not p.requires_grad),
        }
    if rank == 0:
        started = time.perf_counter()
        command = [sys.executable, "-m", "fsdp_strategy", "consolidate", "--format", "peft", "--no-progress"]
        subprocess.run([*command, str(root / "adapter.ckpt"), str(root / "peft")], check=True)
        export_seconds = time.perf_counter() - started
        report = {
            "world_size": world,
            "parameters": counts,
            "sharded_bytes": sizes["sharded"],
            "adapter_bytes": sizes["adapter"],
            "ratio": sizes["adapter"] / sizes["sharded"],
            "peft_export_bytes": bytes_on_disk(root / "peft"),
            "peft_export_seconds": round(export_seconds, 2),
            "arguments": vars(args),
            "torch": torch.__version__,
        }
        print(json.dumps(report, indent=2))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        shutil.rmtree(root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
