"""The model the step-time benchmark trains.

``examples/gpt.py``'s ``GPT`` LightningModule is used when that file exists and exposes it; otherwise a small
GPT-like LightningModule defined here (same shape: token + position embeddings, an ``nn.ModuleList`` of pre-LN
transformer blocks, a final LayerNorm and an output head tied to the token embedding).

Either way :class:`BenchModel` is what every implementation trains: it fixes ``training_step`` (the loss,
nothing logged) and ``configure_optimizers`` (AdamW from :func:`make_optimizer`), so the raw PyTorch loop and
the two Lightning strategies run exactly the same forward, loss and optimizer.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LR = 1e-3
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)


# --- fallback model (only used when examples/gpt.py has no GPT) -----------------------------------------------


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class _FallbackGPT(L.LightningModule):
    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _load_base() -> tuple[type, str]:
    path = os.path.join(REPO_ROOT, "examples", "gpt.py")
    if os.path.isfile(path):
        try:
            spec = importlib.util.spec_from_file_location("_bench_examples_gpt", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            gpt = getattr(module, "GPT", None)
            if isinstance(gpt, type) and issubclass(gpt, L.LightningModule):
                return gpt, "examples/gpt.py:GPT"
        except Exception as err:  # the example is being edited by others; never let it break the benchmark
            print(f"[bench] examples/gpt.py could not be used ({err!r}); using the fallback model", file=sys.stderr)
    return _FallbackGPT, "benchmarks/_model.py:_FallbackGPT"


_Base, MODEL_SOURCE = _load_base()


def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only (a tied weight appears once in ``parameters()``)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class BenchModel(_Base):  # type: ignore[misc, valid-type]
    """The benchmarked LightningModule: the base model's forward, a plain loss, AdamW."""

    log_loss = False  # set True to also pay for ``self.log`` (as examples/gpt.py's own training_step does)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = lm_loss(self(x), y)
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self)


def build_model(*, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                cls: type = BenchModel) -> L.LightningModule:
    return cls(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
