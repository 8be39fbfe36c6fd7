"""Shared pieces of the checkpoint benchmarks (``checkpoint_io.py``, ``consolidate_memory.py``).

The model is deliberately plain: ``N_BLOCKS`` MLP blocks (Linear(D, 4D) -> GELU -> Linear(4D, D)) in an
``nn.ModuleList`` inside a LightningModule, fp32, AdamW.  With the defaults (D=1024, 12 blocks) that is
100.7M parameters; after one AdamW step the model + optimizer state is ~1.2 GB (params, exp_avg, exp_avg_sq).
"""

from __future__ import annotations

import os
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

D_MODEL = int(os.environ.get("CKPT_BENCH_D", "1024"))
N_BLOCKS = int(os.environ.get("CKPT_BENCH_BLOCKS", "12"))
BATCH = 8


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class StackModel(L.LightningModule):
    def __init__(self, d: int = D_MODEL, n_blocks: int = N_BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(4 * BATCH, D_MODEL, generator=g)), batch_size=BATCH)


def n_params(d: int = D_MODEL, n_blocks: int = N_BLOCKS) -> int:
    return n_blocks * (2 * d * 4 * d + 4 * d + d)


def fit_one_step(state_dict_type: str = "sharded", async_save: bool = False):
    """A Trainer that has run one optimizer step (so AdamW state exists). Returns (trainer, seconds)."""
    from fsdp_strategy import FSDP2Strategy

    torch.manual_seed(0)
    model = StackModel()
    trainer = L.Trainer(
        strategy=FSDP2Strategy(state_dict_type=state_dict_type, async_save=async_save),
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(model)
    return trainer, time.perf_counter() - t0


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def machine_note() -> dict:
    import platform

    import lightning
    import psutil

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpu_count": os.cpu_count(),
        "mem_total_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
    }
