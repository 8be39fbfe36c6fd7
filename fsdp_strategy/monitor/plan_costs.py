"""The monitor's bridge to the estimator: a Trainer's strategy and optimizers in the estimator's
names, and from :func:`fsdp_strategy.estimator.model_state.estimate_module` of the live model the bytes its
sharding plan communicates per step and the model state it expects per rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from fsdp_strategy.estimator.model_state import Estimate, estimate_module
from fsdp_strategy.sharding.plan import ShardingPlan

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["communication_estimate", "estimate_figures", "optimizer_name", "plan_of"]


def plan_of(strategy: Any) -> dict[str, Any] | None:
    """The estimator's description of a Trainer strategy, or ``None`` when it has none.

    Any replicated mesh is estimated as ``fsdp2_hybrid``, which reshards after forward: with
    ``reshard_after_forward=False`` the figures are an approximation (the blocks are gathered once
    per micro-batch, not twice, and stay gathered until backward)."""
    sharding = _sharding_plan(strategy)
    if sharding is not None:
        return _fsdp2_plan(sharding)
    if isinstance(strategy, DDPStrategy):
        return {
            "strategy": "ddp",
            "processes_per_node": None,
            "sync_grads_each_micro_batch": False,
            "tensor_parallel_size": 1,
        }
    return None


def _sharding_plan(strategy: Any) -> ShardingPlan | None:
    # FSDP2Strategy's (and its subclasses'): asked for by name, as monitor/ sits below the strategy module.
    describe = getattr(strategy, "sharding_plan", None)
    return describe() if callable(describe) else None


def _fsdp2_plan(plan: ShardingPlan) -> dict[str, Any] | None:
    replicate, shard = plan.mesh_shape
    if plan.cpu_offload:
        name = "fsdp2_offload"
    elif replicate > 1:
        name = "fsdp2_hybrid"
    elif plan.reshard_after_forward is False:
        name = "fsdp2_grad_op"
    elif plan.reshard_after_forward is True:
        name = "fsdp2"
    else:  # resharding to a smaller group in forward is a plan the estimator does not model
        return None
    tensor = plan.tensor_parallel_size
    return {
        "strategy": name,
        "processes_per_node": shard * tensor if replicate > 1 else None,
        "tensor_parallel_size": tensor,
        "sync_grads_each_micro_batch": plan.sync_grads_each_micro_batch,
    }


def optimizer_name(optimizers: list[torch.optim.Optimizer]) -> str | None:
    """The estimator's name for the optimizer(s), or ``None`` for a kind it does not know."""
    names = set()
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the real one
        if isinstance(optimizer, torch.optim.AdamW):
            names.add("adamw")
        elif isinstance(optimizer, torch.optim.Adam):
            names.add("adam")
        elif isinstance(optimizer, torch.optim.SGD):
            momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
            names.add("sgd_momentum" if momentum else "sgd")
        else:
            return None
    return names.pop() if len(names) == 1 else None


def communication_estimate(trainer: pl.Trainer, module: nn.Module) -> tuple[dict[str, Any] | None, str]:
    """Bytes per optimizer step and rank that the sharding plan moves, and the estimated model state;
    or ``None`` and the reason why there is no estimate.

    ``module`` is the live model: once sharded, the estimator reads the units it was sharded into."""
    plan = plan_of(trainer.strategy)
    if plan is None:
        sharding = _sharding_plan(trainer.strategy)
        if sharding is not None:
            return None, f"the estimator has no plan for reshard_after_forward={sharding.reshard_after_forward}"
        return None, f"no sharding plan known for {type(trainer.strategy).__name__}"
    optimizer = optimizer_name(trainer.optimizers)
    if optimizer is None:
        kinds = ", ".join(type(getattr(o, "_optimizer", o)).__name__ for o in trainer.optimizers)
        return None, f"the estimator knows Adam(W) and SGD, not {kinds or 'no optimizer'}"
    estimate = estimate_module(
        module,
        strategy=plan["strategy"],
        world_size=trainer.world_size,
        precision=str(trainer.precision),
        optimizer=optimizer,
        processes_per_node=plan["processes_per_node"],
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        sync_grads_each_micro_batch=plan["sync_grads_each_micro_batch"],
        tensor_parallel_size=plan["tensor_parallel_size"],
    )
    return estimate_figures(estimate), ""


def estimate_figures(estimate: Estimate) -> dict[str, Any]:
    """The estimate's communication per step and the model state per rank, wherever it is kept:
    ``fsdp2_offload`` keeps it in host memory, and the measured state counts it there too."""
    tensor_parallel = estimate.tensor_parallel_all_reduce_bytes
    return {
        "strategy": estimate.strategy,
        "mesh": [*estimate.mesh, estimate.tensor_parallel],  # (replicate, shard, tensor_parallel)
        "tensor_parallel_all_reduce_bytes": None if tensor_parallel is None else float(tensor_parallel),
        "estimate_note": estimate.note,
        "all_gather_bytes": float(estimate.all_gather_bytes),
        "reduce_scatter_bytes": float(estimate.reduce_scatter_bytes),
        "all_reduce_bytes": float(estimate.all_reduce_bytes),
        "sent_bytes": float(estimate.sent_bytes),
        "estimated_model_state_bytes": float(estimate.model_state_bytes + estimate.host_bytes),
    }
