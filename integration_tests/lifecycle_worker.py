"""Many fits in one process, as sweeps and notebooks run them: each rank records, after every run and
``del trainer, model; gc.collect()``, how many LightningModules are still alive and how many bytes of tensors are
reachable, and the parameters each fit ended with.

Runs, each on a fresh Trainer and a fresh module: ``fit`` (seed 0); the same ``fit`` again; a ``fit`` that fails in
``training_step`` at its second batch (a bad trial); a ``fit`` after which the module stays sharded (the strategy
reads no free host memory: it cannot gather the module, as on a machine where it would not fit); ``fit`` then
``validate``, ``test`` and ``predict`` on one Trainer; and the first ``fit`` once more. Rank 0 writes the records
to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_strategy import host_memory
from fsdp_strategy.launch import rendezvous
from testkit.models import TinyLM, token_loader


class StagedLM(TinyLM):
    """TinyLM with a test and a predict step."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)


class Failing(StagedLM):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise RuntimeError("a bad trial")
        return super().training_step(batch, batch_idx)


def reachable() -> tuple[int, int]:
    """LightningModules alive, and bytes of the distinct tensor storages the garbage collector can reach."""
    modules, storages = 0, {}
    for obj in gc.get_objects():
        if isinstance(obj, L.LightningModule):
            modules += 1
        elif isinstance(obj, torch.Tensor):
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            if local.device.type != "meta":
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return modules, sum(storages.values())


def trainer(strategy: str, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **kwargs,
    )


def params(model: torch.nn.Module) -> dict[str, Any]:
    # NumPy copies: the records must not count among the tensors still reachable.
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
        for k, v in model.named_parameters()
    }


def run(strategy: str, kind: str) -> dict[str, Any]:
    L.seed_everything(0)
    model = Failing() if kind == "failed" else StagedLM()
    data = token_loader(samples=32)
    run_trainer = trainer(strategy)
    result: dict[str, Any] = {}
    if kind == "failed":
        try:
            run_trainer.fit(model, data)
        except RuntimeError as error:
            result["error"] = str(error)
    elif kind == "left_sharded":
        available = host_memory.available
        host_memory.available = lambda: 0  # nothing free: the module cannot be gathered
        try:
            run_trainer.fit(model, data)
        finally:
            host_memory.available = available
        result["sharded_after_fit"] = any(isinstance(p, DTensor) for p in model.parameters())
    else:
        run_trainer.fit(model, data)
        if kind == "stages":
            run_trainer.validate(model, token_loader(samples=8), verbose=False)
            run_trainer.test(model, token_loader(samples=8), verbose=False)
            run_trainer.predict(model, token_loader(samples=8))
        result["params"] = params(model)
    del run_trainer, model, data
    gc.collect()
    result["modules"], result["bytes"] = reachable()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # The DDP reference job joins no FSDP2Strategy, whose exit handler it would otherwise get (docs/gloo_exit_abort.py).
    rendezvous.finish_collectives_at_exit()
    gc.collect()
    records: list[dict[str, Any]] = [{"kind": "before", **dict(zip(("modules", "bytes"), reachable()))}]
    for kind in ("fit", "fit", "failed", "left_sharded", "stages", "fit"):
        records.append({"kind": kind, **run(args.strategy, kind)})
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, [{k: v for k, v in r.items() if k != "params"} for r in records])
    if dist.get_rank() == 0:
        torch.save({"records": records, "per_rank": per_rank}, args.out)


if __name__ == "__main__":
    main()
