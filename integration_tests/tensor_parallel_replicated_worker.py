"""A GPT that nothing splits, under ``FSDP2Strategy`` with ``tensor_parallel_size`` above 1 (replicated over the
tensor-parallel ranks, sharded over the data-parallel ones) and under Lightning's ``ModelParallelStrategy`` with a
``configure_model`` that applies ``fully_shard`` over ``self.device_mesh["data_parallel"]`` only, as its user writes.

Each run is ``strategy/module`` (``--runs``), on 4 ranks:

* strategy: ``fsdp2_tp4`` (``tensor_parallel_size=4``: (dp, tp) = (1, 4)), ``fsdp2_tp2`` (``tensor_parallel_size=2``:
  (2, 2)), ``fsdp2_auto`` (``tensor_parallel_size="auto"``: one node of 4 ranks, (1, 4)), ``model_parallel_tp4``
  and ``model_parallel_tp2`` (``ModelParallelStrategy`` on the same meshes); a ``_sharded`` suffix saves a sharded
  checkpoint (``state_dict_type="sharded"``: Distributed Checkpoint, each tensor-parallel rank holding a replica);
* module: ``reads`` (``configure_model`` reads ``self.device_mesh`` for its sizes and names only; under
  ``ModelParallelStrategy`` it also shards the blocks and the model over ``data_parallel``) or ``plain`` (no
  ``configure_model``).

Every run sees the same global batches of 8 sequences, split over its data-parallel ranks. Rank 0 writes, per run, the
full parameters trained, the last loss, the warnings each rank saw that name ``tensor_parallel_size``, whether every
rank's local shards equal those of the ranks of its tensor-parallel group (bitwise), the mesh of the
parameters' DTensors and, under ``FSDP2Strategy``, the
parameters of its checkpoint (its one file, or consolidated into one), to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import fsdp_strategy
from fsdp_strategy.tools.consolidate import consolidate_checkpoint
from testkit.models import token_dataset
from testkit.tensor_parallel import TensorParallelGPT

GLOBAL_BATCH = 8


class MeshReadingGPT(TensorParallelGPT):
    """Splits nothing: its ``configure_model`` reads the mesh; ``shard`` (for ModelParallelStrategy) applies
    ``fully_shard`` over the data-parallel dimension."""

    def __init__(self, shard: bool) -> None:
        super().__init__("none")
        self.shard = shard
        self.mesh_seen: dict[str, int] = {}

    def configure_model(self) -> None:
        mesh = self.device_mesh
        self.mesh_seen = {name: mesh[name].size() for name in mesh.mesh_dim_names}
        if self.shard:
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self.model, mesh=mesh["data_parallel"])


class RecordShards(L.Callback):
    """At the end of training, while the module is sharded: each rank's local shards and the parameters' meshes."""

    def __init__(self) -> None:
        self.shards: list[torch.Tensor] = []
        self.meshes: set = set()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.shards = [local(p).detach().clone() for p in pl_module.parameters()]
        self.meshes = {
            (p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape))
            for p in pl_module.parameters()
            if isinstance(p, DTensor)
        }


def strategy_and_tensor_parallel_size(name: str, world_size: int) -> tuple[object, int]:
    name, sharded = name.removesuffix("_sharded"), name.endswith("_sharded")
    tensor = 2 if name.endswith("tp2") else world_size
    if name.startswith("model_parallel"):
        return ModelParallelStrategy(data_parallel_size=world_size // tensor, tensor_parallel_size=tensor), tensor
    size = "auto" if name == "fsdp2_auto" else tensor
    state_dict_type = "sharded" if sharded else "auto"
    return fsdp_strategy.FSDP2Strategy(tensor_parallel_size=size, state_dict_type=state_dict_type), tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def train(strategy_name: str, module: str, world_size: int, out_dir: Path) -> dict:
    strategy, tensor = strategy_and_tensor_parallel_size(strategy_name, world_size)
    model_parallel = strategy_name.startswith("model_parallel")
    L.seed_everything(42)
    model = MeshReadingGPT(shard=model_parallel) if module == "reads" else TensorParallelGPT("none")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorded := RecordShards()],
    )
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(token_dataset(48), batch_size=GLOBAL_BATCH // (world_size // tensor)))
    seen = [str(w.message) for w in caught if "tensor_parallel_size" in str(w.message)]
    all_seen: list = [None] * world_size
    dist.all_gather_object(all_seen, seen)
    # The ranks of a tensor-parallel group (consecutive: `tensor_parallel` is the last dimension) hold replicas.
    all_shards: list = [None] * world_size
    dist.all_gather_object(all_shards, recorded.shards)
    replicas_equal = all(
        all(torch.equal(a, b) for a, b in zip(all_shards[rank], all_shards[rank - rank % tensor], strict=True))
        for rank in range(world_size)
    )
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
        for name, p in model.named_parameters()
    }
    result = {
        "params": params,
        "start": start,
        # The mesh fully_shard reduces each gradient over: (names, shape) of each parameter's.
        "param_meshes": recorded.meshes,
        "loss": float(trainer.callback_metrics["train_loss"]),
        "warnings": all_seen,
        "replicas_equal": replicas_equal,
        "mesh_seen": getattr(model, "mesh_seen", None),
        "samplers": trainer.strategy.distributed_sampler_kwargs,
    }
    if not model_parallel:
        checkpoint = out_dir / f"{strategy_name}_{module}.ckpt"
        trainer.save_checkpoint(checkpoint)
        if dist.get_rank() == 0:
            # state_dict_type="auto" writes this small a state as one file; a sharded one is consolidated.
            path = (
                checkpoint
                if checkpoint.is_file()
                else consolidate_checkpoint(checkpoint, checkpoint.with_suffix(".full"))
            )
            full = torch.load(path, weights_only=True)
            result["checkpoint"] = dict(full["state_dict"])
        dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world_size = int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    results = {}
    for run in args.runs.split(","):
        strategy, module = run.split("/")
        results[run] = train(strategy, module, world_size, out.parent)
    if dist.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
