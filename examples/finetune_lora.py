"""Fine-tune a pretrained Hugging Face causal LM with LoRA under FSDP2, then hand the adapter to ``peft``.

    python examples/finetune_lora.py                          # 2 CPU processes (or all GPUs), out: <tmp>/finetune_lora
    python examples/finetune_lora.py --devices 4 --max-steps 60 --out lora-run
    python examples/finetune_lora.py --devices 4 --tensor-parallel-size 2   # 2 data x 2 tensor

What it does, as a user fine-tuning a model from the hub would (here the "hub model" is made on the spot):

1. builds a small ``LlamaForCausalLM`` from a ``LlamaConfig`` (no download) and writes it with ``save_pretrained``
   to ``OUT/base``: ``model.safetensors`` and ``config.json``, what a hub download holds;
2. fine-tunes peft LoRA adapters on it with ``strategy=FSDP2Strategy(init_weights=OUT/base, meta_init=True)``: the
   module builds the model from its config alone, without memory, and each rank reads from ``model.safetensors``
   only the rows of its own shards, so no rank ever holds the whole base;
3. saves an adapter checkpoint (``state_dict_type="adapter"``: the LoRA weights and their optimizer state, not the
   frozen base) to ``OUT/lora.ckpt``;
4. exports it as a PEFT adapter directory, ``OUT/adapter`` (``adapter_model.safetensors`` and
   ``adapter_config.json``; the same as ``fsdp-strategy consolidate OUT/lora.ckpt OUT/adapter --format peft``);
5. loads it on one process with ``PeftModel.from_pretrained(base, OUT/adapter)`` and prints the largest difference
   between its logits and the fine-tuned run's.

Nothing here is specific to the tiny model: point ``init_weights`` at any ``save_pretrained`` directory.
The base is written by the launching process before ``fit`` starts the others (Lightning's own launcher); under
``torchrun`` write it first.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

import fsdp_strategy  # registers "fsdp2"; FSDP2Strategy takes the options used here


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--devices", type=int, default=None, help="default: all GPUs, else 2 CPU processes")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "finetune_lora"), help="where it all goes")
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="split the Llama and its adapters by its base_model_tp_plan"
    )
    return p.parse_args()


def save_base_model(folder: Path, seed: int) -> None:
    """The pretrained model of this example: a 3 MB Llama, written as ``save_pretrained`` writes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def counting_task(samples: int, alphabet: int = 32, length: int = 32, seed: int = 0) -> TensorDataset:
    """Sequences that count through the first ``alphabet`` tokens in a stride of 1 to 3, from a random start:
    something a LoRA on a base that never saw them learns within a few dozen steps."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, alphabet, (samples, 1), generator=generator)
    stride = torch.randint(1, 4, (samples, 1), generator=generator)
    tokens = (start + stride * torch.arange(length + 1)) % alphabet
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class LoraFinetune(L.LightningModule):
    """peft's LoRA on every projection of a pretrained causal LM; the base stays frozen.

    The model is built in ``configure_model`` from the base's config, not with ``from_pretrained``: with the
    strategy's ``init_weights`` pointing at the base's directory, each rank loads only its shards of the weights
    after sharding. (Under DDP, or without ``init_weights``, use ``from_pretrained(self.hparams.base)`` here.)
    """

    def __init__(self, base: str, lora_rank: int = 8, learning_rate: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.model is not None:
            return
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hparams.base))
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lora = LoraConfig(r=self.hparams.lora_rank, lora_alpha=2 * self.hparams.lora_rank, target_modules=targets)
        self.model = get_peft_model(base, lora)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = torch.nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.learning_rate)


class StepLosses(L.Callback):
    """Each step's loss, averaged over the ranks."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    out = Path(args.out).resolve()
    base_dir, checkpoint, adapter_dir = out / "base", out / "lora.ckpt", out / "adapter"
    # Lightning's launcher runs this script again in each other process once fit starts; only the first one writes.
    if rank_zero_only.rank == 0:
        save_base_model(base_dir, args.seed)
    L.seed_everything(args.seed)

    on_gpu = torch.cuda.is_available()
    strategy = fsdp_strategy.FSDP2Strategy(
        init_weights=str(base_dir),  # a save_pretrained directory: each rank reads only its shards' rows
        meta_init=True,  # configure_model builds the model without memory; init_weights fills it
        state_dict_type="adapter",  # checkpoints hold what training changes, not the frozen base
        tensor_parallel_size=args.tensor_parallel_size,
    )
    losses = StepLosses()
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=args.devices or (torch.cuda.device_count() if on_gpu else 2),
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[losses],
    )
    module = LoraFinetune(str(base_dir), lora_rank=args.lora_rank, learning_rate=args.learning_rate)
    data = counting_task(samples=args.batch_size * args.max_steps * trainer.world_size)
    trainer.fit(module, DataLoader(data, batch_size=args.batch_size, shuffle=True))
    trainer.save_checkpoint(checkpoint, weights_only=False)  # with the optimizer: resumable
    # After fit the module holds plain (unsharded) tensors again, as under DDP; split over tensor-parallel ranks it
    # stays sharded (as under ModelParallelStrategy), and every rank takes part in its forward.
    tokens = data.tensors[0][:4]
    module.eval()
    with torch.no_grad():
        finetuned = module(tokens.to(module.device)).cpu()
    if not trainer.is_global_zero:
        return

    # One process from here on.
    fsdp_strategy.consolidate_checkpoint(checkpoint, adapter_dir, format="peft", overwrite=True, progress=False)
    with torch.no_grad():
        peft_logits, base_logits = peft_model_logits(base_dir, adapter_dir, tokens)
    difference = (peft_logits - finetuned).abs().max().item()
    base_difference = (base_logits - finetuned).abs().max().item()
    torch.save({"tokens": tokens, "logits": finetuned}, out / "finetuned_logits.pt")

    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    summary = {
        "loss_first": losses.losses[0],
        "loss_last": losses.losses[-1],
        "steps": len(losses.losses),
        "base_bytes": size(base_dir),
        "checkpoint_bytes": size(checkpoint),
        "adapter_bytes": size(adapter_dir),
        "max_logit_difference": difference,
        "max_logit_difference_to_base": base_difference,
        "seconds": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"train loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} in {summary['steps']} steps"
        f" on {trainer.world_size} processes\n"
        f"base {base_dir} ({summary['base_bytes'] / 1e6:.2f} MB)\n"
        f"adapter checkpoint {checkpoint} ({summary['checkpoint_bytes'] / 1e6:.2f} MB)\n"
        f"peft adapter {adapter_dir} ({summary['adapter_bytes'] / 1e6:.2f} MB)\n"
        f"PeftModel.from_pretrained(base, adapter) vs the fine-tuned run: max |logits difference| {difference:.3g}"
        f" (the base alone: {base_difference:.3g})\n"
        f"{summary['seconds']:.1f} s"
    )


def peft_model_logits(base_dir: Path, adapter_dir: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the exported adapter on its base, loaded the way any peft user loads one, and of the base alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    with model.disable_adapter():
        base_logits = model(input_ids=tokens).logits
    return model(input_ids=tokens).logits, base_logits


if __name__ == "__main__":
    main()
