"""Tensor parallelism applied for the user: a Hugging Face model's own ``base_model_tp_plan`` through torch's
``parallelize_module``, or an error that names what to write.

A module written for Lightning's ``ModelParallelStrategy`` splits its layers itself in ``configure_model``
(``parallelize_module`` on ``self.device_mesh["tensor_parallel"]``) and comes to the strategy with DTensors; one
that does not, with ``tensor_parallel_size`` above 1, is split here by the plan its Hugging Face model carries
(``config.base_model_tp_plan``: module names with ``*`` wildcards, each with a style string). The strings name
Transformers' own styles; those that a torch style does alike are in :data:`PLAN_STYLES`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["PLAN_STYLES", "apply_tensor_parallel_plan", "hugging_face_plans", "is_parallelized"]

# Transformers' plan strings -> torch's styles. "colwise" leaves each rank its columns (heads) and output;
# "rowwise" takes them and all-reduces its output; "_rep" ends (or starts) with the whole activation.
PLAN_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
}


def is_parallelized(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensors already: its ``configure_model`` split or sharded it."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def hugging_face_plans(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, str]]]:
    """``(name, base model, plan)`` of each Hugging Face model inside ``model`` whose config has a
    ``base_model_tp_plan``; the outermost one only (a base model inside a model with a head is the same)."""
    found: list[tuple[str, nn.Module, dict[str, str]]] = []
    for name, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if not plan or not hasattr(module, "base_model_prefix"):
            continue
        if any(outer == "" or name.startswith(outer + ".") for outer, _, _ in found):
            continue
        found.append((name, getattr(module, "base_model", module), dict(plan)))
    return found


def apply_tensor_parallel_plan(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Splits each Hugging Face model inside ``model`` over ``mesh`` by its ``base_model_tp_plan``; returns the
    names of the models split. Raises ``ValueError`` when ``model`` has no such plan, or one with a style string
    that :data:`PLAN_STYLES` does not hold."""
    plans = hugging_face_plans(model)
    if not plans:
        raise ValueError(
            f"`tensor_parallel_size={mesh.size()}` needs a tensor-parallel plan, and {type(model).__name__} has none:"
            " it holds no Hugging Face model with a `config.base_model_tp_plan`. Split its layers in the"
            " LightningModule's `configure_model()`, as for Lightning's ModelParallelStrategy:"
            ' `parallelize_module(layer, self.device_mesh["tensor_parallel"], {"proj_in": ColwiseParallel(),'
            ' "proj_out": RowwiseParallel()})` (torch.distributed.tensor.parallel), or set `tensor_parallel_size=1`.'
        )
    for name, base_model, plan in plans:
        styles = {}
        for pattern, style in plan.items():
            if style not in PLAN_STYLES:
                raise ValueError(
                    f"The `base_model_tp_plan` of {type(base_model).__name__} ({name or 'the module'}) splits"
                    f" {pattern!r} as {style!r}, which this strategy does not apply; it applies"
                    f" {', '.join(repr(s) for s in PLAN_STYLES)}. Split the model in `configure_model()` with"
                    " `parallelize_module` instead."
                )
            styles[pattern] = PLAN_STYLES[style]()
        parallelize_module(base_model, mesh, styles)
    return [name for name, _, _ in plans]
