"""Where fine-tuning from pretrained weights starts: the model built from its config in ``configure_model``, the
strategy's ``init_weights`` a ``save_pretrained`` directory, for every case of one launch in one process group.

A case is ``init/model/weights``: ``eager`` or ``meta_init``; ``plain`` (the Hugging Face Llama) or ``lora`` (peft's
LoRA on every projection, peft's init); the directory ``--file`` (one safetensors file) or ``--index`` (several,
with an index). ``--tensor-parallel-size`` above 1 splits the Llama by its ``base_model_tp_plan``. Nothing trains
(``max_steps=0``): rank 0 writes, per case, the logits of one batch right after setup and the adapters' values
gathered whole.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

import fsdp_strategy
from testkit.distributed import full
from testkit.hf import PretrainedLlama
from testkit.models import token_loader

CASES = [
    f"{init}/{model}/{weights}"
    for init in ("eager", "meta_init")
    for model in ("plain", "lora")
    for weights in ("file", "index")
]
LORA_RANK = 3


class AtStart(Callback):
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens, self.logits, self.adapters = tokens, None, {}

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        names = [name for name, _ in module.named_parameters() if "lora_" in name]
        self.adapters = {name.removeprefix("model."): full(module.get_parameter(name)).clone() for name in names}
        module.eval()
        with torch.no_grad():
            self.logits = module(self.tokens)
        module.train()


def start(case: str, directories: dict[str, str], tensor_parallel_size: int) -> dict[str, Any]:
    init, model, weights = case.split("/")
    L.seed_everything(3)
    at_start = AtStart(next(iter(token_loader(batch_size=4, samples=8)))[0])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directories[weights]).to_dict()
    module = PretrainedLlama(config, lora_rank=LORA_RANK if model == "lora" else None)
    strategy = fsdp_strategy.FSDP2Strategy(
        init_weights=directories[weights], meta_init=init == "meta_init", tensor_parallel_size=tensor_parallel_size
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        max_steps=0,
        callbacks=[at_start],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, token_loader(batch_size=2, samples=2))
    return {"logits": at_start.logits, "adapters": at_start.adapters}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--file", required=True, help="a save_pretrained directory of one safetensors file")
    parser.add_argument("--index", required=True, help="a save_pretrained directory of several files and an index")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    directories = {"file": args.file, "index": args.index}
    results = {case: start(case, directories, args.tensor_parallel_size) for case in CASES}
    if int(os.environ["RANK"]) == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
