"""A GPT written for Lightning's ``ModelParallelStrategy`` (``testkit.tensor_parallel``) and Hugging Face Llamas under
``fsdp2`` with ``tensor_parallel_size=2`` (with hybrid sharding too), under ``ModelParallelStrategy`` itself, and as
plain modules under 1-D ``fsdp2`` and DDP: the runs each test compares.

Each run is ``strategy/parallelize/clip``, optionally followed by ``/precision=P`` and ``/accumulate=N`` (``--runs``):

* strategy: ``fsdp2`` (1-D, as many ranks as the launch), ``fsdp2_tp`` (``tensor_parallel_size=2``),
  ``fsdp2_hybrid_tp`` (``replicate_size=2, tensor_parallel_size=2``: a 2 x 1 x 2 mesh on 4 ranks) and
  ``fsdp2_hybrid_tp_sync`` (the same with ``sync_grads_each_micro_batch=True``),
  ``model_parallel`` (Lightning's ``ModelParallelStrategy(data_parallel_size=world/2, tensor_parallel_size=2)``),
  ``registered`` (``Trainer(strategy="fsdp2_tp")``: one node's ranks are one tensor-parallel group) or ``ddp``;
* parallelize: the module's ``configure_model`` (``TensorParallelGPT(parallelize=...)``): ``tp_fsdp``, ``tp``, ``none``;
  or ``hf``: a tiny Hugging Face Llama (``testkit.hf.TinyLlama``) without ``configure_model``, split by its own
  ``base_model_tp_plan`` under ``fsdp2_tp``; or ``lora``: that Llama with peft LoRA adapters on a colwise
  (``q_proj``) and two rowwise (``o_proj``, ``down_proj``) layers, the rest frozen; or ``example``: ``testkit.llama_tensor_parallel``, a module shaped as
  Lightning's own tensor-parallel example;
* clip: ``clip`` (``gradient_clip_val=0.05``, which clips every step here) or ``noclip`` (Lightning's
  ``ModelParallelStrategy`` cannot clip gradients on two meshes);
* precision: ``Trainer(precision=...)``, ``32-true`` when not given; accumulate: ``accumulate_grad_batches``.

Every run sees the same global batches of 8 sequences, split over its data-parallel ranks.

Under ``fsdp2`` the module records Lightning's ``grad_norm`` of every step in ``on_before_optimizer_step`` (under
``ModelParallelStrategy`` it fails there on the gradients' shards). Rank 0 writes, per run,
the full parameters at the start and trained (as fp32), the last loss, those norms, every rank's
``distributed_sampler_kwargs``, the dtypes of the parameters after training and those of the ``nn.Linear`` layers'
outputs in training and, for a run given ``accumulate``, its collectives per optimizer step over each mesh dimension
(``testkit.collectives``) to ``--out``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import fsdp_strategy
from testkit.collectives import CountCollectives
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


GLOBAL_BATCH = 8


def strategy_and_data_parallel_ranks(strategy_name: str, world_size: int) -> tuple[object, int]:
    if strategy_name == "fsdp2":
        return fsdp_strategy.FSDP2Strategy(), world_size
    if strategy_name == "ddp":
        return "ddp", world_size
    if strategy_name == "fsdp2_tp":
        return fsdp_strategy.FSDP2Strategy(tensor_parallel_size=2), world_size // 2
    if strategy_name.startswith("fsdp2_hybrid_tp"):  # (dp_replicate, dp_shard, tensor_parallel) = (2, 1, 2)
        sync = strategy_name == "fsdp2_hybrid_tp_sync"
        strategy = fsdp_strategy.FSDP2Strategy(
            replicate_size=2, tensor_parallel_size=2, sync_grads_each_micro_batch=sync
        )
        return strategy, world_size // 2
    if strategy_name == "registered":  # one node: its devices are one tensor-parallel group
        return "fsdp2_tp", 1
    return ModelParallelStrategy(data_parallel_size=world_size // 2, tensor_parallel_size=2), world_size // 2


def record_linear_output_dtypes(model: nn.Module) -> set[torch.dtype]:
    """The dtypes the ``nn.Linear`` layers of ``model`` compute in, filled while it runs."""
    seen: set[torch.dtype] = set()

    def record(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
        seen.add(output.dtype)

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(record)
    return seen


def train(
    strategy_name: str, parallelize: str, clip: bool, world_size: int, precision: str, accumulate: int | None
) -> dict:
    strategy, data_parallel_ranks = strategy_and_data_parallel_ranks(strategy_name, world_size)
    L.seed_everything(42)
    collectives = CountCollectives()
    if parallelize == "hf":
        model: L.LightningModule = TinyLlama()
    elif parallelize == "lora":
        model = TinyLlama(lora_targets=["q_proj", "o_proj", "down_proj"])
    elif parallelize == "example":
        model = TensorParallelLlama()
    else:
        model = RecordedGPT(parallelize, record_norms=strategy_name != "model_parallel")
    compute_dtypes = record_linear_output_dtypes(model)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=3,
        accumulate_grad_batches=accumulate or 1,
        gradient_clip_val=0.05 if clip else None,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[collectives] if accumulate else [],  # a run given its accumulation counts its collectives
    )
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.fit(model, DataLoader(token_dataset(48), batch_size=GLOBAL_BATCH // data_parallel_ranks))
    samplers: list = [None] * world_size
    dist.all_gather_object(samplers, trainer.strategy.distributed_sampler_kwargs)
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
        for name, p in model.named_parameters()
    }
    return {
        "params": params,
        "start": start,
        "param_dtypes": {p.dtype for p in model.parameters()},
        "compute_dtypes": compute_dtypes,
        "loss": float(trainer.callback_metrics["train_loss"]),
        "norms": getattr(model, "norms", []),
        "samplers": samplers,
        "collectives_per_step": collectives.over_mesh(getattr(trainer.strategy, "device_mesh", None)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {}
    world_size = int(os.environ["WORLD_SIZE"])
    for run in args.runs.split(","):
        strategy, parallelize, clip, *named = run.split("/")
        options = dict(field.split("=", 1) for field in named)
        accumulate = int(options["accumulate"]) if "accumulate" in options else None
        results[run] = train(
            strategy, parallelize, clip == "clip", world_size, options.get("precision", "32-true"), accumulate
        )
    if dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
