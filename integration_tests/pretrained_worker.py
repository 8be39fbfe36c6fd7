"""Fine-tunes a pretrained Hugging Face Llama under "fsdp2" (``init_weights`` = the weights directory, the model
built from its config) and under "ddp" (``from_pretrained`` in ``configure_model``), one run after the other.

Arguments: ``--weights`` (a ``save_pretrained`` directory), ``--meta-init``, ``--steps``, ``--out``, and
``--tensor-parallel-size``: above 1 the runs are "fsdp2_tp" (``tensor_parallel_size`` on the same weights, the
Llama split by its ``base_model_tp_plan``) and its reference "fsdp2" (1-D). Rank 0 writes per run: the logits of
one batch right after setup (fsdp2: on the sharded module), the parameters gathered whole right after setup, each
step's loss, and the final parameters; and, per parameter, the rows of the file each rank read (to show the shards
were uneven).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

import fsdp_strategy
from fsdp_strategy.checkpoint.pretrained import local_region
from testkit.distributed import full
from testkit.hf import PretrainedLlama
from testkit.models import token_loader


class Record(Callback):
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens, self.losses, self.logits, self.rows, self.loaded = tokens, [], None, {}, {}

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.loaded = {name: full(param).detach().clone() for name, param in module.named_parameters()}
        for name, param in module.named_parameters():
            if isinstance(param, DTensor):
                region = local_region(param)[0]
                assert param.to_local().shape[0] == region.stop - region.start, name
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, (region.start, region.stop))
                self.rows[name] = gathered
        # After the rows: the root unit keeps its parameters gathered after a forward.
        module.eval()
        with torch.no_grad():
            self.logits = module(self.tokens)
        module.train()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())


def run(strategy: str, args: argparse.Namespace, config: dict) -> dict:
    L.seed_everything(3)
    tokens = next(iter(token_loader(batch_size=4, samples=8)))[0]
    record = Record(tokens)
    if strategy.startswith("fsdp2"):
        tensor_parallel_size = args.tensor_parallel_size if strategy == "fsdp2_tp" else 1
        chosen = fsdp_strategy.FSDP2Strategy(
            init_weights=args.weights, meta_init=args.meta_init, tensor_parallel_size=tensor_parallel_size
        )
        module = PretrainedLlama(config)
    else:
        chosen, module = "ddp", PretrainedLlama(config, weights=args.weights)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=chosen,
        max_steps=args.steps,
        callbacks=[record],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, token_loader(batch_size=2, samples=2 * args.steps))
    # Plain again after a 1-D fit; split over tensor_parallel the module stays sharded, as ModelParallelStrategy's.
    params = {name: full(p).detach().clone() for name, p in module.named_parameters()}
    return {
        "logits": record.logits,
        "loaded": record.loaded,
        "losses": record.losses,
        "params": params,
        "rows": record.rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", required=True)
    parser.add_argument("--meta-init", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.weights).to_dict()
    runs = ("fsdp2", "ddp") if args.tensor_parallel_size == 1 else ("fsdp2_tp", "fsdp2")
    results = {strategy: run(strategy, args, config) for strategy in runs}
    if int(os.environ["RANK"]) == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
