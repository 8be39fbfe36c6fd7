"""A LoRA fine-tuning run (a tiny Hugging Face Llama from ``from_pretrained``, peft adapters) under "fsdp2", twice
from the same start: once saving an adapter checkpoint, once a sharded one. Each is then resumed into a freshly built
module for two more steps. Rank 0 writes what the tests compare (``--out``): each resume's starting parameters and
optimizer state and its final parameters, both runs' trained parameters, the trained module's logits on one batch
(plain again after ``fit``, as under DDP), and the checkpoints' sizes on disk.

Arguments: ``--base`` (the ``save_pretrained`` folder of the base), ``--root`` (where checkpoints go), ``--out``,
``--tensor-parallel-size`` (the Llama split by its ``base_model_tp_plan``, the LoRA matrices along with the layers
they adapt). The data-parallel ranks read the same batches as a 1-D run on as many ranks does.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

import fsdp_strategy
from testkit import full
from testkit.callbacks import StartState
from testkit.hf import LoraLlama
from testkit.models import token_loader

STEPS, MORE_STEPS = 3, 2


def trainer(
    kind: str, steps: int, root: Path, tensor_parallel_size: int, callbacks: list[Any] | None = None
) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=fsdp_strategy.FSDP2Strategy(state_dict_type=kind, tensor_parallel_size=tensor_parallel_size),
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )


def params(module: L.LightningModule) -> dict[str, torch.Tensor]:
    return {name: full(p).detach().clone() for name, p in module.named_parameters()}


def split_over_tensor_parallel(param: torch.Tensor) -> bool:
    names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
    return "tensor_parallel" in names and not param.placements[names.index("tensor_parallel")].is_replicate()


def bytes_on_disk(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    root, tensor_parallel_size = Path(args.root), args.tensor_parallel_size
    data_parallel_size = int(os.environ["WORLD_SIZE"]) // tensor_parallel_size
    data = token_loader(batch_size=2, samples=4 * STEPS * data_parallel_size)
    results: dict[str, Any] = {}
    for kind in ("adapter", "sharded"):
        L.seed_everything(7)
        fit = trainer(kind, STEPS, root, tensor_parallel_size)
        module = LoraLlama(args.base)
        fit.fit(module, data)
        path = root / f"{kind}.ckpt"
        fit.save_checkpoint(path)
        results[f"{kind}/trained"] = params(module)
        results[f"{kind}/bytes"] = bytes_on_disk(path)
        results["frozen_bytes"] = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
        results["trainable"] = sorted(name for name, p in module.named_parameters() if p.requires_grad)
        results["split"] = sorted(name for name, p in module.named_parameters() if split_over_tensor_parallel(p))
        if kind == "adapter":
            module.eval()
            tokens = next(iter(token_loader(batch_size=4, samples=8)))[0]
            with torch.no_grad():
                results["tokens"], results["logits"] = tokens, module(tokens)

        L.seed_everything(8)  # other LoRA values than the run's: the resume must replace them
        start = StartState()
        resumed = LoraLlama(args.base)
        trainer(kind, STEPS + MORE_STEPS, root, tensor_parallel_size, [start]).fit(resumed, data, ckpt_path=path)
        results[f"{kind}/start"] = {"params": start.params, "optimizer": start.optimizer}
        results[f"{kind}/resumed"] = params(resumed)
    if int(os.environ["RANK"]) == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
