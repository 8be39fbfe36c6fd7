"""A tiny GPT in a LightningModule written for Lightning's ``ModelParallelStrategy``: its ``configure_model``
splits each block's attention heads and MLP over ``self.device_mesh["tensor_parallel"]`` (``parallelize_module``)
and shards the blocks and the model over ``self.device_mesh["data_parallel"]`` (``fully_shard``)."""

from __future__ import annotations

import torch
from lightning import LightningModule
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from testkit.models import VOCAB

__all__ = ["GPT", "TensorParallelGPT", "plan_styles", "tensor_parallel_plan"]


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its own heads' columns of q, k and v.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x))))


class GPT(nn.Module):
    def __init__(self, width: int = 16, heads: int = 4, layers: int = 2, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tensor_parallel_plan() -> dict[str, ColwiseParallel | RowwiseParallel]:
    """Megatron's split of a block: q, k, v and the MLP's first layer by columns, their outputs by rows."""
    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
    }


def plan_styles(prefix: str = "model.blocks.*.") -> dict[str, str]:
    """:func:`tensor_parallel_plan` as the estimator reads a plan (``tensor_parallel_plan=``): Transformers' style
    strings by module name, under ``prefix`` (the blocks of :class:`TensorParallelGPT`'s ``model`` by default)."""
    return {
        prefix + layer: "colwise" if isinstance(style, ColwiseParallel) else "rowwise"
        for layer, style in tensor_parallel_plan().items()
    }


class TensorParallelGPT(LightningModule):
    """``parallelize``: ``"tp_fsdp"`` (both in ``configure_model``, as for ModelParallelStrategy), ``"tp"`` (tensor
    parallelism only, the data-parallel sharding left to the strategy) or ``"none"`` (a plain module)."""

    def __init__(self, parallelize: str = "tp_fsdp", lr: float = 1e-2) -> None:
        super().__init__()
        self.parallelize, self.lr = parallelize, lr
        self.model = GPT()

    def configure_model(self) -> None:
        if self.parallelize == "none":
            return
        for block in self.model.blocks:
            parallelize_module(block, self.device_mesh["tensor_parallel"], tensor_parallel_plan())
            if self.parallelize == "tp_fsdp":
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
        if self.parallelize == "tp_fsdp":
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
