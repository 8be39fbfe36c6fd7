"""A small Llama-like model in a LightningModule shaped as Lightning's own tensor-parallel example is: a ``parallelize``
function that ``configure_model`` calls on ``self.device_mesh``, splitting the embedding, every block's attention
and SwiGLU feed-forward and the output head over ``["tensor_parallel"]`` (``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel``) and sharding each block and the model over ``["data_parallel"]``
(``fully_shard``). Written here, not copied; Lightning's example also splits the sequence between norms, left out."""

from __future__ import annotations

import torch
from lightning import LightningModule
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from testkit.models import VOCAB

__all__ = ["Llama", "TensorParallelLlama", "parallelize"]


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.wq, self.wk, self.wv = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.wo = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: a tensor-parallel rank holds its own heads' columns of wq, wk and wv.
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attention = SelfAttention(width, heads)
        self.feed_forward = FeedForward(width, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, width: int = 16, heads: int = 4, layers: int = 2, vocab: int = VOCAB) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(TransformerBlock(width, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.output = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parallelize(model: Llama, device_mesh: DeviceMesh) -> Llama:
    """Tensor parallelism over ``device_mesh["tensor_parallel"]``, then FSDP2 over ``["data_parallel"]``."""
    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    # The embedding's vocabulary rows split, its output whole; the head's vocabulary columns split, gathered whole.
    ends = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, ends)
    for layer in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        parallelize_module(layer, tp_mesh, plan)
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


class TensorParallelLlama(LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.model = Llama()

    def configure_model(self) -> None:
        parallelize(self.model, self.device_mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
