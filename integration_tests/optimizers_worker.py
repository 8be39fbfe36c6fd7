"""Optimizers that read whole tensors, and training steps that read whole parameters, under ``fsdp2`` and ``ddp``.

Each run is ``strategy/scenario`` (``--runs``), a scenario ``optimizer[+penalty][+manual][+accumulate][+hybrid]``
(``hybrid``: ``fsdp2`` on a (replicate, shard) = (2, W/2) mesh), or
``save:optimizer:format`` (fit 3 steps and save) and ``resume:optimizer:format`` (resume that checkpoint to 6 steps,
on this launch's world size, which may differ from the saving launch's). Rank 0 writes a dict of results to
``--out``: the parameters after the fit and the logged metrics.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch

import fsdp_strategy
from testkit.optimizers import Regression, regression_loader


def _strategy(strategy: str, state_dict_type: str = "full", replicate_size: int | None = None) -> Any:
    if strategy != "fsdp2":
        return strategy
    return fsdp_strategy.FSDP2Strategy(state_dict_type=state_dict_type, replicate_size=replicate_size)


def _trainer(strategy: Any, **options: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def _result(model: torch.nn.Module, trainer: L.Trainer) -> dict[str, Any]:
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
    }


def fit(strategy: str, scenario: str) -> dict[str, Any]:
    """``optimizer`` is a name of testkit.optimizers.OPTIMIZERS or ``torch.optim.<Class>``; an error (a refusal)
    is the result, as ``Type: message``."""
    optimizer, *flags = scenario.split("+")
    penalty = next((f for f in flags if f not in ("manual", "accumulate", "hybrid", "index_write")), "none")
    L.seed_everything(42)
    model = Regression(optimizer, penalty=penalty, manual="manual" in flags, index_write="index_write" in flags)
    accumulate = 2 if "accumulate" in flags else 1
    chosen = _strategy(strategy, replicate_size=2 if "hybrid" in flags else None)
    validation = regression_loader(samples=16) if penalty != "none" else None
    evaluate = {"val_check_interval": 4, "limit_val_batches": 2} if validation is not None else {}
    steps = 6 if "." not in optimizer else 3
    trainer = _trainer(chosen, max_steps=steps, accumulate_grad_batches=accumulate, **evaluate)
    try:
        trainer.fit(model, regression_loader(), validation)
    except Exception as error:  # noqa: BLE001 - the refusal is what the test reads
        return {"error": f"{type(error).__name__}: {error}", "global_step": trainer.global_step}
    return _result(model, trainer)


def save_or_resume(strategy: str, scenario: str) -> dict[str, Any]:
    action, optimizer, state_dict_type = scenario.split(":")
    path = Path.cwd() / f"{strategy}-{optimizer}-{state_dict_type}.ckpt"  # ddp writes its one format, "full"
    L.seed_everything(42)
    model = Regression(optimizer)
    trainer = _trainer(_strategy(strategy, state_dict_type), max_steps=3 if action == "save" else 6)
    trainer.fit(model, regression_loader(), ckpt_path=path if action == "resume" else None)
    if action == "save":
        trainer.save_checkpoint(path)
    return _result(model, trainer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help="comma-separated strategy/scenario")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {}
    for run in args.runs.split(","):
        strategy, scenario = run.split("/")
        results[run] = (save_or_resume if ":" in scenario else fit)(strategy, scenario)
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
