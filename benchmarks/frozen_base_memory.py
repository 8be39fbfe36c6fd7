"""Parameter, gradient and optimizer-state bytes per rank of a LoRA fine-tune: nothing frozen, a frozen fp32 base,
a frozen base stored in bf16 (``frozen_dtype="bfloat16"``) and in NF4 (``frozen_dtype="nf4"``), measured against the
estimator's figures.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/frozen_base_memory.py

The module: a Hugging Face Llama built from a config (hidden size 512, MLP 1024, 4 layers, vocabulary 1024, 10.5M
parameters) with peft LoRA adapters of rank 8 on every projection (0.5M parameters), AdamW, ``32-true``. Each variant
trains 2 steps under ``FSDP2Strategy``; at the second step's ``on_before_optimizer_step`` each rank counts the bytes
it holds of its parameters (local shards; an NF4 weight by its codes and scales), their gradients and the
optimizer's state (``fsdp_strategy.sharding.state_bytes.held_bytes``). The estimate is ``estimate_module`` for
``fsdp2`` at the same world size on the module as built (NF4 is not estimated). Rank 0 prints a Markdown table and,
with ``--json``, writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp_strategy import FSDP2Strategy  # noqa: E402
from fsdp_strategy.estimator.model_state import estimate_module  # noqa: E402
from fsdp_strategy.sharding.state_bytes import held_bytes, optimizer_state_tensors  # noqa: E402

MiB = 2**20
VOCAB, SEQ, LOCAL_BATCH = 1024, 32, 2
# variant: (what is frozen, frozen_dtype)
VARIANTS = {
    "nothing frozen": (False, None),
    "frozen base, fp32": (True, None),
    "frozen base, bf16": (True, "bfloat16"),
    "frozen base, nf4": (True, "nf4"),
}


class LoraLlama(L.LightningModule):
    def __init__(self, freeze_base: bool) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=SEQ,
        )
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        self.model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules=targets))
        if not freeze_base:
            self.model.requires_grad_(True)
        self.held: dict[str, int] = {}

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.trainer.global_step == 1:  # the optimizer's state exists from the first step on
            params = list(self.parameters())
            self.held = {
                "params": held_bytes(params),
                "grads": held_bytes([p.grad for p in params if p.grad is not None]),
                "optimizer": held_bytes(optimizer_state_tensors([optimizer])),
            }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def measure(freeze_base: bool, frozen_dtype: str | None, world: int) -> dict:
    L.seed_everything(0)
    model = LoraLlama(freeze_base)
    estimate = None
    if frozen_dtype != "nf4":
        row = estimate_module(model, strategy="fsdp2", world_size=world, frozen_dtype=frozen_dtype)
        estimate = {"params": row.param_bytes, "grads": row.grad_bytes, "optimizer": row.optimizer_bytes}
    tokens = torch.randint(0, VOCAB, (4 * LOCAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=FSDP2Strategy(frozen_dtype=frozen_dtype, hook_view="sharded"),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=LOCAL_BATCH))
    per_rank: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(per_rank, model.held)
    return {"measured": per_rank, "estimate": estimate}


def table(results: dict, world: int) -> str:
    def mib(value: int | None) -> str:
        return "n/a" if value is None else f"{value / MiB:.2f}"

    rows = [
        f"| variant ({world} ranks) | params | grads | optimizer | total | estimate: params / grads / optimizer |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, result in results.items():
        held = result["measured"][0]  # rank 0 holds the largest shards
        estimate = result["estimate"] or {}
        estimated = " / ".join(mib(estimate.get(key)) for key in ("params", "grads", "optimizer"))
        rows.append(
            f"| {name} | {mib(held['params'])} | {mib(held['grads'])} | {mib(held['optimizer'])}"
            f" | {mib(sum(held.values()))} | {estimated} |"
        )
    return "\n".join(rows) + "\n\nMiB on rank 0."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    results = {name: measure(freeze, dtype, world) for name, (freeze, dtype) in VARIANTS.items()}
    if dist.get_rank() == 0:
        print(table(results, world))
        if args.json:
            with open(args.json, "w") as file:
                json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
