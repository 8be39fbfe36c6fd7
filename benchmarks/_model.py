"""The model the scripts in ``benchmarks/`` train: the example GPT with the training step (next-token
cross-entropy, nothing logged) and AdamW of ``fsdp-strategy benchmark`` (``fsdp_strategy/tools/benchmark/worker.py``),
so that they measure what that command measures.
"""

from __future__ import annotations

import lightning as L

from fsdp_strategy.tools.benchmark.gpt import GPT
from fsdp_strategy.tools.benchmark.worker import benchmark_class

MODEL_SOURCE = "fsdp_strategy.tools.benchmark.gpt:GPT"
BenchModel = benchmark_class(GPT, "fsdp2")


def build_model(
    *, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, cls: type = BenchModel
) -> L.LightningModule:
    return cls(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
