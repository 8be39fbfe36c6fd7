"""The example GPT: a small GPT-style (decoder-only) language model, a plain LightningModule.

It is the default model of ``fsdp-strategy benchmark`` and of ``examples/`` (which import it from here).
Nothing in it knows about ``fsdp_strategy``: the same module trains with ``strategy="ddp"`` or
``strategy="fsdp2"``. It is written so that sharding works well:

* the transformer blocks are held in an ``nn.ModuleList`` (``GPT.blocks``), so ``FSDP2Strategy`` can find the
  repeated ``Block`` modules and shard each one on its own;
* every module that owns parameters has a ``reset_parameters()`` method, so the model can be created on the
  ``meta`` device and initialized after sharding;
* ``lm_head.weight`` is tied to ``tok_emb.weight`` (one parameter used in two places).

:data:`GPT_SIZES` names a few shapes (``n_layer``, ``n_head``, ``n_embd``) for the benchmark.
"""

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

# GPT-2 style initialization, N(0, 0.02) weights and zero biases, lives in ``reset_parameters()`` so that it is
# also what a model created on the meta device gets. Embedding and Linear use the same rule, so the tied
# embedding / output weight has the same distribution whichever of its two modules initializes it last.


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)
        self._fill_padding_idx_with_zero()


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = Linear(n_embd, 3 * n_embd)
        self.proj = Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.proj = Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(L.LightningModule):
    """A GPT-style decoder for next-byte prediction.

    Args:
        vocab_size: number of tokens (256 for raw bytes).
        block_size: maximum sequence length (size of the position embedding).
        n_layer, n_head, n_embd: depth, attention heads and width of the transformer.
        dropout: dropout probability (embeddings, attention, residual branches).
        learning_rate: peak learning rate of AdamW.
        weight_decay: AdamW weight decay, applied only to parameters with 2 or more dimensions.
        warmup_steps: linear warm-up length in optimizer steps (0: none).
        lr_schedule: ``"constant"`` or ``"cosine"`` (cosine decay to ``min_lr_ratio * learning_rate``
            over the run, ``trainer.estimated_stepping_batches`` steps).
        min_lr_ratio: final learning rate of the cosine schedule, as a fraction of ``learning_rate``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {lr_schedule!r}")
        self.save_hyperparameters()
        self.tok_emb = Embedding(vocab_size, n_embd)
        self.pos_emb = Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids of shape (B, T) to next-token logits of shape (B, T, vocab_size)."""
        T = idx.size(1)
        if T > self.hparams.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.hparams.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]  # a tied weight appears once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # biases, LayerNorm
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=(0.9, 0.95))
        if hp.warmup_steps <= 0 and hp.lr_schedule == "constant":
            return optimizer

        total_steps = max(1, int(self.trainer.estimated_stepping_batches))

        def lr_factor(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            if hp.lr_schedule == "constant":
                return 1.0
            progress = min(1.0, (step - hp.warmup_steps) / max(1, total_steps - hp.warmup_steps))
            return hp.min_lr_ratio + (1.0 - hp.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# Shapes by name; with a byte vocabulary (256) and block_size 128 they have about 0.12M, 10.8M, 25M and 116M
# parameters. "large" is the size whose training state dominates a process's memory (the memory target's).
GPT_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64},
    "small": {"n_layer": 6, "n_head": 6, "n_embd": 384},
    "medium": {"n_layer": 8, "n_head": 8, "n_embd": 512},
    "large": {"n_layer": 12, "n_head": 14, "n_embd": 896},
}
