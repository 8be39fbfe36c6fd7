"""A LoRA on a frozen base stored in a lower dtype (``frozen_dtype``) under ``fsdp2``, and its one-process reference.

Scenarios (``--runs strategy/scenario,...``; strategy ``fsdp2`` under torchrun, ``single`` in one process that takes
each global batch whole):

* ``bf16``: a tiny Hugging Face Llama with peft LoRA adapters, frozen base in bfloat16, fp32 adapters, ``32-true``;
  its MLP's 18 rows and the adapters' rank of 3 leave padded, uneven shards on
  4 ranks.
* ``bf16_mixed``: the same under ``bf16-mixed``.
* ``fp32``: the same with the frozen base left in float32 (``frozen_dtype=None``).
* ``nf4``: a Llama with hidden size 256, its frozen projections quantized to torchao's NF4 (QLoRA).

``--tensor-parallel-size`` splits the Llama (and its adapters) by its ``base_model_tp_plan`` under ``fsdp2``; the
data-parallel ranks then read what the ranks of a 1-D run on as many ranks read.

The reference builds the same model and converts the same frozen weights the way a user's script would, before
``Trainer.fit``; each run returns the per-step global loss, the trained adapters (whole), and
the bytes of parameters, gradients and optimizer state rank 0 holds after the last step with the estimator's figures.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.estimator.model_state import estimate_module
from fsdp_strategy.sharding.frozen import nf4_fits, torchao_to_nf4
from fsdp_strategy.sharding.state_bytes import held_bytes, optimizer_state_tensors
from integration_tests.finetune_worker import VOCAB, full_params, loader, make_trainer

SCENARIOS = {
    # scenario: (frozen_dtype, precision, hidden size, intermediate size)
    "fp32": (None, "32-true", 12, 18),
    "bf16": ("bfloat16", "32-true", 12, 18),
    "bf16_mixed": ("bfloat16", "bf16-mixed", 12, 18),
    "nf4": ("nf4", "32-true", 256, 512),
}


class LoraLlama(L.LightningModule):
    """A tiny Llama built from a config, with peft's LoRA adapters on every projection; records its losses."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lora = LoraConfig(r=3, lora_alpha=6, lora_dropout=0.0, target_modules=targets)
        self.model = get_peft_model(LlamaForCausalLM(config), lora)
        for name, param in self.model.named_parameters():  # LoRA's B starts at zero: give the test something to train
            if "lora_B" in name:
                nn.init.normal_(param, std=0.1)
        self.losses: list[torch.Tensor] = []
        self.held: dict[str, int] = {}

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, _ = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.detach().float())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # After the last optimizer step, before the next zero_grad: parameters, gradients and optimizer state held.
        params = list(self.parameters())
        self.held = {
            "params": held_bytes(params),
            "grads": held_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": held_bytes(optimizer_state_tensors(self.trainer.optimizers)),
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.02)


def local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def convert_frozen_as_a_user_would(model: nn.Module, frozen_dtype: str, world: int) -> None:
    """The reference's own conversion: every frozen parameter cast, or frozen Linear weights quantized to NF4
    (those whose blocks split over ``world`` ranks, as the strategy picks them)."""
    if frozen_dtype is None:
        return
    if frozen_dtype == "nf4":
        to_nf4 = torchao_to_nf4()
        for module in model.modules():
            if isinstance(module, nn.Linear) and not module.weight.requires_grad:
                if nf4_fits(tuple(module.weight.shape), world):
                    module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
        return
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16)


def run(
    strategy: str,
    scenario: str,
    *,
    devices: int,
    world: int,
    rank: int | None,
    root: str,
    tensor_parallel_size: int,
    intermediate_size: int | None = None,
) -> dict[str, Any]:
    frozen_dtype, precision, hidden, intermediate = SCENARIOS[scenario]
    intermediate = intermediate_size or intermediate
    L.seed_everything(0)
    steps = 4
    model = LoraLlama(hidden, intermediate)
    estimate = None
    if frozen_dtype != "nf4":  # the estimator counts dtypes by their item size; NF4's is not a whole number
        row = estimate_module(model, strategy="fsdp2", world_size=world, precision=precision, frozen_dtype=frozen_dtype)
        estimate = {"params": row.param_bytes, "grads": row.grad_bytes, "optimizer": row.optimizer_bytes}
    if strategy == "single":
        convert_frozen_as_a_user_would(model, frozen_dtype, world)
        trainer = make_trainer("single", 1, max_steps=steps, default_root_dir=root, precision=precision)
    else:
        chosen = FSDP2Strategy(frozen_dtype=frozen_dtype, tensor_parallel_size=tensor_parallel_size)
        trainer = make_trainer(chosen, devices, max_steps=steps, default_root_dir=root, precision=precision)  # type: ignore[arg-type]
    trainer.fit(model, loader("tokens", steps, world, rank))
    losses = torch.stack(model.losses)
    if (
        rank is not None
    ):  # equal local batches: the global loss is the mean of the ranks' (a tensor-parallel group's alike)
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    params = full_params(model)
    # An NF4 weight is a Parameter around torchao's NF4Tensor, whose dtype is the one it was quantized from.
    frozen_kinds = sorted({f"{type(p.data).__name__}/{p.dtype}" for p in model.parameters() if not p.requires_grad})
    return {
        "losses": losses,
        "adapters": {name: value for name, value in params.items() if "lora_" in name},
        "frozen_kinds": frozen_kinds,
        # What a frozen DTensor holds, besides the dtype it reports.
        "frozen_local_dtypes": sorted({str(local(p).dtype) for p in model.parameters() if not p.requires_grad}),
        "optimizer_state_entries": [len(o.state) for o in trainer.optimizers],
        "held": model.held,  # rank 0's, which holds the largest shards
        "estimate": estimate,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True)
    parser.add_argument("--world", type=int, help="ranks of the job whose batches a single process takes whole")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--intermediate-size", type=int, help="the Llama's MLP width, in place of the scenario's")
    args = parser.parse_args()
    distributed = "LOCAL_WORLD_SIZE" in os.environ
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    world = devices // args.tensor_parallel_size if distributed else args.world
    results = {}
    for entry in args.runs.split(","):
        strategy, scenario = entry.split("/")
        root = os.path.join(os.getcwd(), entry.replace("/", "-"))
        results[entry] = run(
            strategy,
            scenario,
            devices=devices,
            world=world,
            rank=rank // args.tensor_parallel_size if distributed else None,
            root=root,
            tensor_parallel_size=args.tensor_parallel_size,
            intermediate_size=args.intermediate_size,
        )
    if rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
