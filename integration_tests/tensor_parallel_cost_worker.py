"""What a 2 x 2 tensor-parallel run (``FSDP2Strategy(tensor_parallel_size=2)`` on 4 gloo ranks) really holds and
moves, for ``test_tensor_parallel_costs`` to hold the estimator and the monitor to.

Each run (``--runs``) is the GPT of ``testkit.tensor_parallel``, which splits its blocks in ``configure_model``
(``tp_fsdp``: it shards them over ``data_parallel`` too; ``tp``: the strategy does), or ``hf``: the tiny Hugging Face
Llama of ``testkit.hf``, which the strategy splits by its ``base_model_tp_plan``. Each rank measures, per run:

* the collectives of the first optimizer step, by kind (``testkit.collectives``): FSDP2's c10d all-gathers and
  reduce-scatters, and DTensor's functional all-reduces of activations over the tensor-parallel ranks;
* its parameters, gradients and optimizer state just before the last optimizer step (without the step counters,
  which the estimator leaves out), and ``estimate_module`` of the live, split and sharded model then;
* ``ShardingMonitor``'s summary.

Rank 0 writes ``{run: {field: [per rank]}, run/monitor: summary}`` as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch.distributed as dist
from torch.utils.data import DataLoader

import fsdp_strategy
from fsdp_strategy import ShardingMonitor
from fsdp_strategy.estimator.model_state import estimate_module
from fsdp_strategy.sharding.state_bytes import model_state_bytes
from testkit.collectives import CollectiveCounter, bytes_by_source
from testkit.hf import TinyLlama
from testkit.models import token_dataset
from testkit.tensor_parallel import TensorParallelGPT

BATCH_SIZE = 4  # samples per data-parallel rank and step
STEPS = 2  # optimizer state exists from the second step's optimizer_step on


class _Measure(L.Callback):
    def __init__(self) -> None:
        self.collectives = CollectiveCounter()
        self.held: int | None = None
        self.live_estimate: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if batch_idx == 0:
            self.collectives.__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == 0:
            self.collectives.__exit__(None, None, None)  # forward and backward of the first step are in
        if trainer.global_step != STEPS - 1:
            return
        self.held = model_state_bytes(pl_module, [getattr(optimizer, "_optimizer", optimizer)], scalar_state=False)
        estimate = estimate_module(pl_module, strategy="fsdp2", world_size=trainer.world_size, tensor_parallel_size=2)
        self.live_estimate = estimate.as_dict()


def train(run: str) -> tuple[dict, dict]:
    L.seed_everything(0)
    measure, monitor = _Measure(), ShardingMonitor(warmup_steps=1, count_flops=False, live_tensor_steps=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        # The measurement reads each rank's shards in on_before_optimizer_step, not parameters gathered for it.
        strategy=fsdp_strategy.FSDP2Strategy(tensor_parallel_size=2, hook_view="sharded"),
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[measure, monitor],
    )
    model = TinyLlama() if run == "hf" else TensorParallelGPT(run)
    trainer.fit(model, DataLoader(token_dataset(32), batch_size=BATCH_SIZE))
    mine = {
        "collectives": bytes_by_source(measure.collectives.records),
        "held": measure.held,
        "live_estimate": measure.live_estimate,
    }
    per_rank: list = [None] * trainer.world_size
    dist.all_gather_object(per_rank, mine)
    return {name: [rank[name] for rank in per_rank] for name in mine}, monitor.summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default="tp_fsdp,tp,hf")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {}
    for run in args.runs.split(","):
        results[run], results[f"{run}/monitor"] = train(run)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
