"""Modules that DDP handles with options or broadcasts: their runs under ``fsdp2`` and under DDP.

* ``moe``: a mixture of experts that skips idle experts. Tokens go to experts by hashing their id (a
  learned gate weighs each expert's output), so the data decide which experts work: on rank 0 expert 2
  never gets a token, on rank 1 it does; expert 3 gets tokens in the first two batches, then none on any
  rank. DDP needs ``ddp_find_unused_parameters_true`` for it.
* ``branch``: a second task whose head is used only for batches that contain a marker token: a
  data-dependent branch in the LightningModule itself (the FSDP root).
* ``experts_*``: experts that ``wrap_policy="auto"`` makes units of their own, as the repeated children of a
  plain ``nn.ModuleList`` on the LightningModule itself (``experts_root``) or in the one MoE layer
  (``experts_layer``). Every rank routes tokens to every expert in the first two batches; from the third on,
  expert 2 runs on even ranks only and expert 3 on odd ranks only: each rank runs three experts, their
  all-gathers pair up without a word, and the strategy must stop with ``UnitMismatchError`` before the
  third optimizer step (``*_manual``: manual optimization; ``*_validate``: ``trainer.validate``).
  ``experts_layer_fixed`` trains with the ``wrap_policy`` that error names; ``*_two_steps`` are the DDP
  references for the parameters at the error.
* ``gan``: manual optimization with two optimizers and two ``manual_backward`` calls per step, whose
  critic has a counting branch used for batches with the marker token only (``branch`` data).
* ``bn``: a CNN with BatchNorm and a running-scale normalizer that reads its buffer in the training
  forward, built with a different random init on each rank (no ``seed_everything``). DDP trains it from
  rank 0's init and broadcasts rank 0's buffers. ``bn_manual``: the same under manual optimization.
* ``syncbn``: the same CNN with ``Trainer(sync_batchnorm=True)``, which cannot run on the CPU: the
  error and whether the module was converted are recorded.

Each run is ``strategy/scenario`` (``--runs``); rank 0 writes a dict of results to ``--out``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

import fsdp_strategy  # noqa: F401  (registers the strategy names)
from testkit.dropin import (
    ExpertsLM,
    ManualCNN,
    TinyCNN,
    TinyMoE,
    TwoOptimizerLM,
    TwoTaskLM,
    image_loader,
    token_loader,
)

SCENARIOS: dict[str, dict] = {
    "moe": {"model": "moe"},
    "moe_sgd": {"model": "moe", "optimizer": "sgd"},
    "moe_accumulate": {"model": "moe", "accumulate": 2},
    "moe_sgd_accumulate": {"model": "moe", "optimizer": "sgd", "accumulate": 2},
    # expert 3 is used in the first two micro-batches of the first step only
    "moe_sgd_accumulate4": {"model": "moe", "optimizer": "sgd", "accumulate": 4, "max_steps": 3},
    "branch": {"model": "branch"},
    "gan": {"model": "gan"},
    "experts_root": {"model": "experts_root", "fails": True},
    "experts_root_manual": {"model": "experts_root", "manual": True, "fails": True},
    "experts_root_validate": {"model": "experts_root", "validate": True, "fails": True},
    "experts_layer": {"model": "experts_layer", "fails": True},
    "experts_layer_fixed": {"model": "experts_layer", "wrap_policy": ["Block", "MoEBlock"]},
    "experts_root_two_steps": {"model": "experts_root", "max_steps": 2},
    "experts_root_manual_two_steps": {"model": "experts_root", "manual": True, "max_steps": 2},
    "experts_layer_two_steps": {"model": "experts_layer", "max_steps": 2},
    "branch_sgd_accumulate": {"model": "branch", "optimizer": "sgd", "accumulate": 2},
    "bn": {"model": "bn"},
    "bn_adamw_accumulate": {"model": "bn", "optimizer": "adamw", "accumulate": 2},
    "bn_manual": {"model": "bn", "manual": True},
    "syncbn": {"model": "bn", "sync_batchnorm": True},
}


class BatchNormClasses(L.Callback):
    """The BatchNorm classes of the module when ``fit`` fails (in setup), before the strategy's teardown."""

    def __init__(self) -> None:
        self.at_failure: list[str] = []

    def on_exception(self, trainer, pl_module, exception) -> None:  # type: ignore[no-untyped-def]
        self.at_failure = _batchnorm_classes(pl_module)


def _batchnorm_classes(module: nn.Module) -> list[str]:
    return [type(m).__name__ for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class BufferRecorder(L.Callback):
    """Each rank's buffers after the last training batch (before validation broadcasts them)."""

    def __init__(self) -> None:
        self.after_last_batch: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.after_last_batch = {k: v.detach().clone() for k, v in pl_module.named_buffers()}


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if any(isinstance(p, DTensor) for p in model.parameters()):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        buffers = dict(model.named_buffers())
        return {k: v.float() for k, v in state.items() if k not in buffers}
    return {k: v.detach().float().clone() for k, v in model.named_parameters()}


def train(strategy: str, scenario: dict, *, devices: int, rank: int, max_steps: int) -> dict:
    accumulate = scenario.get("accumulate", 1)
    max_steps = scenario.get("max_steps", max_steps)
    batches = max_steps * accumulate
    if "wrap_policy" in scenario:
        strategy = fsdp_strategy.FSDP2Strategy(wrap_policy=scenario["wrap_policy"], state_dict_type="full")
    if strategy == "fsdp2_hybrid_sync":  # 2 replicas, sharded accumulation: all-reduce on the last micro-batch
        strategy = fsdp_strategy.FSDP2Strategy(replicate_size=2, sync_grads_each_micro_batch=True)
    if scenario["model"].startswith("experts"):
        L.seed_everything(42)
        model = ExpertsLM(layer=scenario["model"] == "experts_layer", manual=scenario.get("manual", False))
        loader = token_loader("experts", rank=rank, batch_size=2, batches=batches)
        val_loader = loader if scenario.get("validate") else None
    elif scenario["model"] == "gan":
        L.seed_everything(42)
        model = TwoOptimizerLM()
        loader = token_loader("branch", rank=rank, batch_size=2, batches=batches)
        val_loader = None
    elif scenario["model"] == "bn":
        torch.manual_seed(1000 + rank)  # no seed_everything: every rank builds its own random init
        model: L.LightningModule = (ManualCNN if scenario.get("manual") else TinyCNN)(scenario.get("optimizer", "sgd"))
        loader = image_loader(rank=rank, batch_size=4, batches=batches)
        val_loader = image_loader(rank=rank, batch_size=4, batches=2, seed=2)
    else:
        L.seed_everything(42)
        model_class = TinyMoE if scenario["model"] == "moe" else TwoTaskLM
        model = model_class(scenario.get("optimizer", "adamw"))
        loader = token_loader(scenario["model"], rank=rank, batch_size=2, batches=batches)
        val_loader = loader if scenario["model"] == "moe" else None
    recorder, batchnorms = BufferRecorder(), BatchNormClasses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        sync_batchnorm=scenario.get("sync_batchnorm", False),
        use_distributed_sampler=False,  # each rank's batches are laid out above
        limit_val_batches=(batches if scenario.get("validate") else 2) if val_loader is not None else 0,
        val_check_interval=batches,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, batchnorms],
    )
    if scenario.get("fails"):
        try:
            if scenario.get("validate"):
                trainer.validate(model, loader, verbose=False)
            else:
                trainer.fit(model, loader)
            error = None
        except fsdp_strategy.UnitMismatchError as exc:
            error = f"{type(exc).__name__}: {exc}"
        errors: list = [None] * trainer.world_size
        dist.all_gather_object(errors, error)
        return {"errors": errors, "params": _full_params(model), "global_step": trainer.global_step}
    if scenario.get("sync_batchnorm"):
        try:
            trainer.fit(model, loader, val_loader)
            error = None
        except Exception as exc:  # noqa: BLE001  (the error is the result)
            error = f"{type(exc).__name__}: {exc}"
        return {"error": error, "at_failure": batchnorms.at_failure, "after_fit": _batchnorm_classes(model)}
    trainer.fit(model, loader, val_loader)
    per_rank: list = [None] * trainer.world_size
    dist.all_gather_object(
        per_rank,
        {
            "buffers_after_last_batch": recorder.after_last_batch,
            "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        },
    )
    return {
        "params": _full_params(model),
        "per_rank": per_rank,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help=f"comma-separated strategy/scenario ({', '.join(SCENARIOS)})")
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    results = {}
    for run in args.runs.split(","):
        strategy, scenario = run.split("/")
        results[run] = train(strategy, SCENARIOS[scenario], devices=devices, rank=rank, max_steps=args.max_steps)
    if rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
