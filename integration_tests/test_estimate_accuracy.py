"""The estimator against real training on 2 CPU ranks under fsdp2 and ddp.

The test launches this file as a torchrun module. Each rank trains ``OddLM`` for a few steps per
configuration and measures

* its parameters, gradients and optimizer state (``fsdp_strategy.sharding.state_bytes.model_state_bytes``,
  without the step counters the estimator leaves out) just before the last optimizer step, when all
  three exist, and the estimate of the live, already sharded model;
* under fsdp2, the bytes that FSDP2's all-gathers and reduce-scatters move during the first
  optimizer step (every micro-batch of it), as the dispatcher sees the collectives.

The test compares them with :func:`estimate_module` of the same model built on the meta device: the
issue asks for at most 10% error in model state, and the test holds it to 1% (0.28% measured);
communication must match exactly.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_strategy
from fsdp_strategy.estimator.model_state import estimate_module
from fsdp_strategy.sharding.state_bytes import model_state_bytes
from integration_tests.conftest import torchrun
from testkit.models import VOCAB, WIDTH, TinyLM, token_loader


class OddLM(TinyLM):
    """TinyLM with an odd number of embedding rows: at 2 ranks rank 0 holds 17 of them, rank 1 holds 16."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer=optimizer)
        self.embed = nn.Embedding(VOCAB + 1, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB + 1, bias=False)
        self.head.weight = self.embed.weight


# (strategy, precision, optimizer as the estimator names it, OddLM's optimizer argument, micro-batches per step)
CONFIGS = [
    ("fsdp2", "32-true", "adamw", "adamw", 1),
    ("ddp", "32-true", "adamw", "adamw", 1),
    ("fsdp2", "bf16-mixed", "adamw", "adamw", 2),
    ("ddp", "bf16-mixed", "adamw", "adamw", 1),
    ("fsdp2", "bf16-mixed", "sgd_momentum", "sgd", 1),
]
STEPS = 2  # optimizer state exists from the second step's optimizer_step on


def test_estimates_agree_with_training(tmp_path: Path) -> None:
    out = tmp_path / "measured.json"
    torchrun("integration_tests.test_estimate_accuracy", ["--out", str(out)], nproc=2, cwd=tmp_path)
    measured = json.loads(out.read_text())
    for strategy, precision, optimizer, model_optimizer, accumulate in CONFIGS:
        key = f"{strategy}/{precision}/{optimizer}"
        with torch.device("meta"):
            model = OddLM(optimizer=model_optimizer)
        estimate = estimate_module(
            model,
            strategy=strategy,
            world_size=2,
            precision=precision,
            optimizer=optimizer,
            accumulate_grad_batches=accumulate,
        )
        held = max(measured[key]["held"])  # rank 0 holds the larger shards (17 of the 33 embedding rows)
        error = abs(estimate.model_state_bytes - held) / held
        assert error <= 0.01, f"{key}: estimated {estimate.model_state_bytes} bytes, measured {held} ({error:.1%})"
        assert measured[key]["live_estimate"] == [estimate.model_state_bytes] * 2, key
        if strategy == "fsdp2":
            expected = [[estimate.all_gather_bytes, estimate.reduce_scatter_bytes]] * 2
            assert measured[key]["collective_bytes"] == expected, key


class _CollectiveBytes(TorchDispatchMode):
    """Adds up the output of FSDP2's all-gathers and the input of its reduce-scatters.

    A plain dispatch mode (the one torch's own CommDebugMode builds on): CommDebugMode's module
    tracker fails on Lightning's step methods routed through FSDP.
    """

    def __init__(self) -> None:
        super().__init__()
        self.all_gather = self.reduce_scatter = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        packet = getattr(func, "_overloadpacket", None)
        if packet is torch.ops.c10d._allgather_base_:  # (output, input, group, ...)
            self.all_gather += args[0].numel() * args[0].element_size()
        elif packet is torch.ops.c10d._reduce_scatter_base_:  # (output, input, group, ...)
            self.reduce_scatter += args[1].numel() * args[1].element_size()
        return func(*args, **(kwargs or {}))


class _Measure(L.Callback):
    def __init__(self, strategy: str, precision: str, optimizer: str) -> None:
        self.config = (strategy, precision, optimizer)
        self.held: int | None = None
        self.live_estimate: int | None = None
        self.collectives: _CollectiveBytes | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if batch_idx == 0 and self.config[0] == "fsdp2":
            self.collectives = _CollectiveBytes()
            self.collectives.__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == 0 and self.collectives is not None:
            self.collectives.__exit__(None, None, None)  # every micro-batch of the first step is in
        if trainer.global_step != STEPS - 1:
            return
        self.held = model_state_bytes(pl_module, [getattr(optimizer, "_optimizer", optimizer)], scalar_state=False)
        strategy, precision, name = self.config
        estimate = estimate_module(
            pl_module, strategy=strategy, world_size=trainer.world_size, precision=precision, optimizer=name
        )
        self.live_estimate = estimate.model_state_bytes


def _train(strategy: str, precision: str, optimizer: str, model_optimizer: str, accumulate: int) -> dict:
    L.seed_everything(0)
    measure = _Measure(strategy, precision, optimizer)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        # _Measure reads each rank's shards and counts the step's collectives in on_before_optimizer_step: the
        # hook must see the shards, not the whole parameters gathered for it.
        strategy=fsdp_strategy.FSDP2Strategy(hook_view="sharded") if strategy == "fsdp2" else strategy,
        precision=precision,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[measure],
    )
    trainer.fit(OddLM(optimizer=model_optimizer), token_loader())
    collective_bytes = None
    if measure.collectives is not None:
        collective_bytes = [measure.collectives.all_gather, measure.collectives.reduce_scatter]
    result = {"held": measure.held, "live_estimate": measure.live_estimate, "collective_bytes": collective_bytes}
    per_rank: list = [None] * trainer.world_size
    dist.all_gather_object(per_rank, result)
    return {name: [rank[name] for rank in per_rank] for name in result}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {"/".join(config[:3]): _train(*config) for config in CONFIGS}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
