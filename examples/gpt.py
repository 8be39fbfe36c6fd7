"""A small GPT-style (decoder-only) language model and a byte-level text datamodule.

``GPT`` is a plain LightningModule: nothing in it knows about ``fsdp_strategy``, and the same module trains with
``strategy="ddp"`` or ``strategy="fsdp2"``. It is defined in ``fsdp_strategy/tools/benchmark/gpt.py`` (the model that
``fsdp-strategy benchmark`` runs by default) and re-exported here; read that file for how it is written so that
sharding works well (blocks in an ``nn.ModuleList``, ``reset_parameters()`` everywhere, a tied output head).

``ByteTextDataModule`` needs no download: its corpus is the Python standard library's own source code, which
exists on every machine that can run this file.
"""

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from fsdp_strategy.tools.benchmark.gpt import (
    GPT,
    GPT_SIZES,
    MLP,
    Block,
    CausalSelfAttention,
    Embedding,
    Linear,
)

__all__ = [
    "GPT",
    "GPT_SIZES",
    "MLP",
    "Block",
    "ByteTextDataModule",
    "ByteWindows",
    "CausalSelfAttention",
    "Embedding",
    "Linear",
    "stdlib_corpus",
]


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
        stride: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

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
