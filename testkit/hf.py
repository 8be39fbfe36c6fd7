"""A tiny Hugging Face Llama in a LightningModule, built from a config (no download); needs ``transformers``."""

from __future__ import annotations

from typing import Any

import torch
from lightning import LightningModule

from testkit.models import VOCAB

__all__ = [
    "LORA_TARGETS",
    "SPLIT_LLAMA",
    "TINY_LLAMA",
    "UNEVEN_LLAMA",
    "LoraLlama",
    "PretrainedLlama",
    "TinyLlama",
    "lora_model",
    "save_tiny_llama",
]

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}

# First dimensions 2 and 4 ranks do not divide: vocabulary 37, key/value projections 3 x 6 = 18 rows, an MLP of 5
# rows (at 4 ranks 2, 2, 1 and none: the last rank holds nothing of it).
UNEVEN_LLAMA: dict[str, Any] = {
    **TINY_LLAMA,
    "vocab_size": 37,
    "hidden_size": 36,
    "intermediate_size": 5,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
}

# For tensor_parallel_size=2: whole attention heads per rank (4 query, 2 key/value heads of 8), and shards that
# data_parallel cuts unevenly: the embedding's 37 rows (not split by the plan) 19/18, an MLP of 6 rows 3/3 over
# tensor_parallel, then 2/1 over data_parallel. (DTensor's colwise matmul needs tensor_parallel to divide them.)
SPLIT_LLAMA: dict[str, Any] = {**TINY_LLAMA, "vocab_size": 37, "intermediate_size": 6}


class TinyLlama(LightningModule):
    """``self.model`` is a ``LlamaForCausalLM``; its config is a hyper-parameter (a plain dict), as a recipe
    that builds the model from a config keeps it. Batches are ``token_loader``'s ``(tokens, targets)``.
    With ``lora_targets`` peft wraps those layers in LoRA adapters (rank 3, B initialized random, not zero, so that
    the adapters count from the first step) and freezes the rest."""

    def __init__(
        self, config: dict[str, Any] | None = None, lr: float = 1e-2, lora_targets: list[str] | None = None
    ) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        if config is None:
            config = LlamaConfig(**TINY_LLAMA).to_dict()
        self.save_hyperparameters()
        self.model = LlamaForCausalLM(LlamaConfig.from_dict(config))
        if lora_targets:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=3, lora_alpha=6, target_modules=lora_targets, init_lora_weights=False)
            self.model = get_peft_model(self.model, lora)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


# Every projection, as examples/finetune_lora.py adapts them: colwise and rowwise layers of the tensor-parallel plan.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class PretrainedLlama(LightningModule):
    """A recipe that fine-tunes a pretrained Llama: the model is built in ``configure_model``, from ``weights``
    with ``from_pretrained`` (as under DDP), or from the config alone when the strategy's ``init_weights`` loads
    them (under ``meta_init`` on the meta device). With ``lora_rank`` peft wraps :data:`LORA_TARGETS` in LoRA
    adapters of peft's own init (B zero: the logits before the first step are the base's)."""

    def __init__(
        self, config: dict[str, Any], weights: str | None = None, lr: float = 1e-2, lora_rank: int | None = None
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Any = None

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig

        if self.model is not None:
            return
        if self.hparams.weights is None:
            self.model = AutoModelForCausalLM.from_config(LlamaConfig.from_dict(self.hparams.config))
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.hparams.weights)
        if self.hparams.lora_rank is not None:
            self.model = lora_model(self.model, self.hparams.lora_rank)

    forward = TinyLlama.forward
    training_step = TinyLlama.training_step
    configure_optimizers = TinyLlama.configure_optimizers


def lora_model(model: Any, rank: int) -> Any:
    """``model`` with peft's LoRA adapters of ``rank`` on :data:`LORA_TARGETS`, the rest frozen."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS))


def save_tiny_llama(folder: str, seed: int = 0) -> str:
    """A tiny Llama's weights and config, as ``save_pretrained`` writes them: the base a fine-tuning run starts from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(folder)
    return folder


class LoraLlama(LightningModule):
    """A LoRA fine-tuning recipe: the base from ``from_pretrained``, peft's adapters on the attention projections
    (rank 3: shards of 2/1 rows on 2 ranks, 1/1/1/0 on 4), an optimizer of the trainable parameters."""

    def __init__(self, base: str, lr: float = 1e-2) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        self.save_hyperparameters()
        lora = LoraConfig(r=3, lora_alpha=6, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(LlamaForCausalLM.from_pretrained(base), lora)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return torch.nn.functional.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)
