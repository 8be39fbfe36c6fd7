"""What ordinary Lightning code reads during a fit, under ``fsdp2`` and under ``ddp`` (2 CPU ranks):

* ``clip_value``, ``clip_norm``: a module and a callback that read the gradients in ``on_after_backward``,
  ``on_before_optimizer_step`` and ``configure_gradient_clipping`` (where the module compares them with a plain
  tensor after clipping), with ``gradient_clip_algorithm="value"`` / ``"norm"``, and ``accumulate_grad_batches=2``
  for the first; the model summary during and after the fit.
* ``double``: the same with ``Trainer(precision="64-true")`` and norm clipping.
* ``no_optimizer``, ``unused_optimizer``, ``later_optimizer`` (and ``*_sharded``, ``state_dict_type="sharded"``):
  ``configure_optimizers`` returning None, two optimizers of which one never steps, and an optimizer added by a
  callback in the second epoch; each fit saves a checkpoint, which a second fit resumes from.

Each run is ``strategy/scenario`` (``--runs``); rank 0 writes a dict of results to ``--out``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch

import fsdp_strategy
from testkit.dropin_hooks import (
    AddOptimizer,
    CallbackReader,
    HookReader,
    OptimizerConfigs,
    SummaryReader,
    summary_fields,
)
from testkit.models import token_loader

HOOKS = {
    "clip_value": {"gradient_clip_algorithm": "value", "gradient_clip_val": 0.02, "accumulate_grad_batches": 2},
    "clip_norm": {"gradient_clip_algorithm": "norm", "gradient_clip_val": 0.5},
    "double": {"gradient_clip_algorithm": "norm", "gradient_clip_val": 0.5, "precision": "64-true"},
}
OPTIMIZERS = {"no_optimizer": "none", "unused_optimizer": "unused", "later_optimizer": "later"}


def _trainer(strategy: Any, **options: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **options,
    )


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def read_hooks(strategy: str, scenario: str) -> dict[str, Any]:
    options = dict(HOOKS[scenario])
    precision = options.pop("precision", "32-true")
    L.seed_everything(42)
    callback, summary = CallbackReader(), SummaryReader()
    trainer = _trainer(strategy, precision=precision, max_steps=3, callbacks=[callback, summary], **options)
    with trainer.init_module():
        model = HookReader()
    trainer.fit(model, token_loader(samples=32))
    return {
        "module": dict(model.seen),
        "callback": dict(callback.seen),
        "summary_during": summary.during,
        "summary_after": summary_fields(model),
        "state": _state(model),
    }


def resume_optimizers(strategy: str, scenario: str) -> dict[str, Any]:
    sharded = scenario.endswith("_sharded")
    mode = OPTIMIZERS[scenario.removesuffix("_sharded")]
    path = Path.cwd() / f"{strategy}-{scenario}.ckpt"
    fits = []
    for epochs, resume in ((2, None), (3, path)):
        L.seed_everything(42)
        chosen = fsdp_strategy.FSDP2Strategy(state_dict_type="sharded" if sharded else "full")
        trainer = _trainer(chosen if strategy == "fsdp2" else strategy, max_epochs=epochs, callbacks=[AddOptimizer()])
        model = OptimizerConfigs(mode)
        trainer.fit(model, token_loader(samples=16), ckpt_path=resume)
        if resume is None:
            trainer.save_checkpoint(path)
        states = [len(optimizer.state) for optimizer in trainer.optimizers]
        fits.append({"state": _state(model), "optimizer_entries": states, "global_step": trainer.global_step})
    return {"fits": fits}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help="comma-separated strategy/scenario")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {}
    for run in args.runs.split(","):
        strategy, scenario = run.split("/")
        read = read_hooks if scenario in HOOKS else resume_optimizers
        results[run] = read(strategy, scenario)
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
