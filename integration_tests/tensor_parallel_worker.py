"""A GPT written for Lightning's ``ModelParallelStrategy`` (``testkit.tensor_parallel``) under ``fsdp2`` with
``tensor_parallel_size=2``, under ``ModelParallelStrategy`` itself, and as a plain module under 1-D ``fsdp2``.

Each run is ``strategy/parallelize/clip`` (``--runs``):

* strategy: ``fsdp2`` (1-D, as many ranks as the launch), ``fsdp2_tp`` (``tensor_parallel_size=2``) or
  ``model_parallel`` (Lightning's ``ModelParallelStrategy(data_parallel_size=world/2, tensor_parallel_size=2)``);
* parallelize: the module's ``configure_model`` (``TensorParallelGPT(parallelize=...)``): ``tp_fsdp``, ``tp``, ``none``;
  or ``hf``: a tiny Hugging Face Llama (``testkit.hf.TinyLlama``) without ``configure_model``, split by its own
  ``base_model_tp_plan`` under ``fsdp2_tp``; or ``lora``: that Llama with peft LoRA adapters on a colwise
  (``q_proj``) and two rowwise (``o_proj``, ``down_proj``) layers, the rest frozen; or ``example``: ``testkit.llama_tensor_parallel``, a module shaped as
  Lightning's own tensor-parallel example;
* clip: ``clip`` (``gradient_clip_val=0.05``, which clips every step here) or ``noclip`` (Lightning's
  ``ModelParallelStrategy`` cannot clip gradients on two meshes).

Under ``fsdp2`` the module records Lightning's ``grad_norm`` of every step in ``on_before_optimizer_step`` (under
``ModelParallelStrategy`` it fails there on the gradients' shards). Rank 0 writes, per run,
the full parameters (at the start and trained), the last loss, those norms and every rank's ``distributed_sampler_kwargs`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import grad_norm
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import fsdp_strategy
from testkit.hf import TinyLlama
from testkit.llama_tensor_parallel import TensorParallelLlama
from testkit.models import token_dataset
from testkit.tensor_parallel import TensorParallelGPT


class RecordedGPT(TensorParallelGPT):
    def __init__(self, parallelize: str, record_norms: bool) -> None:
        super().__init__(parallelize)
        self.record_norms = record_norms
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.record_norms:
            self.norms.append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))


def train(strategy_name: str, parallelize: str, clip: bool, world_size: int) -> dict:
    if strategy_name == "fsdp2":
        strategy = fsdp_strategy.FSDP2Strategy()
    elif strategy_name == "fsdp2_tp":
        strategy = fsdp_strategy.FSDP2Strategy(tensor_parallel_size=2)
    else:
        strategy = ModelParallelStrategy(data_parallel_size=world_size // 2, tensor_parallel_size=2)
    L.seed_everything(42)
    if parallelize == "hf":
        model: L.LightningModule = TinyLlama()
    elif parallelize == "lora":
        model = TinyLlama(lora_targets=["q_proj", "o_proj", "down_proj"])
    elif parallelize == "example":
        model = TensorParallelLlama()
    else:
        model = RecordedGPT(parallelize, record_norms=strategy_name != "model_parallel")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=3,
        gradient_clip_val=0.05 if clip else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.fit(model, DataLoader(token_dataset(48), batch_size=4))
    samplers: list = [None] * world_size
    dist.all_gather_object(samplers, trainer.strategy.distributed_sampler_kwargs)
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return {
        "params": params,
        "start": start,
        "loss": float(trainer.callback_metrics["train_loss"]),
        "norms": getattr(model, "norms", []),
        "samplers": samplers,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {}
    world_size = int(os.environ["WORLD_SIZE"])
    for run in args.runs.split(","):
        strategy, parallelize, clip = run.split("/")
        results[run] = train(strategy, parallelize, clip == "clip", world_size)
    if dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
