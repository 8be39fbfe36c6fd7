"""A small GPT-style (decoder-only) language model and a byte-level text datamodule.

Nothing in this file knows about ``fsdp_strategy``: ``GPT`` is a plain LightningModule, and the same module
trains with ``strategy="ddp"`` or ``strategy="fsdp2"``. It is written so that sharding works well:

* the transformer blocks are held in an ``nn.ModuleList`` (``GPT.blocks``), so ``FSDP2Strategy`` can find the
  repeated ``Block`` modules and shard each one on its own;
* every module that owns parameters has a ``reset_parameters()`` method, so the model can be created on the
  ``meta`` device and initialized after sharding;
* ``lm_head.weight`` is tied to ``tok_emb.weight`` (one parameter used in two places).

``ByteTextDataModule`` needs no download: its corpus is the Python standard library's own source code, which
exists on every machine that can run this file.
"""

import math
import os
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


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
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
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


def stdlib_corpus(max_bytes: int) -> bytes:
    """The top-level ``*.py`` files of the standard library, in sorted order, joined, cut to ``max_bytes``."""
    root = os.path.dirname(os.__file__)
    parts, total = [], 0
    for name in sorted(os.listdir(root)):
        if total >= max_bytes:
            break
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                parts.append(f.read())
            total += len(parts[-1]) + 1
    return b"\n".join(parts)[:max_bytes]


class ByteWindows(Dataset):
    """Fixed windows of ``block_size + 1`` bytes taken every ``stride`` bytes; item i is (input, target)."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int) -> None:
        self.data, self.block_size, self.stride = data, block_size, stride

    def __len__(self) -> int:
        return max(0, (len(self.data) - self.block_size - 1) // self.stride + 1)

    def __getitem__(self, i: int):
        chunk = self.data[i * self.stride : i * self.stride + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class ByteTextDataModule(L.LightningDataModule):
    """Byte-level language modelling on the Python standard library's source code.

    Args:
        block_size: sequence length of one sample (must match the model's ``block_size`` or be smaller).
        batch_size: samples per batch and per process.
        max_bytes: size of the corpus in bytes (the first ``max_bytes`` of the sorted stdlib files).
        val_fraction: the last ``val_fraction`` of the corpus is the validation set.
        stride: distance between consecutive windows (default ``block_size``: no overlap between inputs).
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        stride: Optional[int] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: Optional[ByteWindows] = None
        self.val_set: Optional[ByteWindows] = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        data = torch.frombuffer(bytearray(stdlib_corpus(hp.max_bytes)), dtype=torch.uint8)
        split = int(len(data) * (1.0 - hp.val_fraction))
        stride = hp.stride or hp.block_size
        self.train_set = ByteWindows(data[:split], hp.block_size, stride)
        self.val_set = ByteWindows(data[split:], hp.block_size, stride)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
