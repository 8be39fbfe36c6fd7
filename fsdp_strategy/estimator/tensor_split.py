"""Which parameters tensor parallelism splits, along which dimension, and which layers all-reduce activations.

A model already split (the monitor's live model) says so itself: each DTensor parameter's placement on the mesh's
``tensor_parallel`` dimension (``Shard(d)`` or ``Replicate()``). A model built on the meta device and not yet split
(``fsdp-strategy estimate``) is read through a plan of Transformers' style strings, by module name with ``*``
wildcards: the one given, or its Hugging Face model's ``base_model_tp_plan``, as the strategy would apply it. Without
either the split cannot be known, and :func:`tensor_splits` says so instead of guessing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdp_strategy.sharding.mesh import TENSOR_PARALLEL_DIM
from fsdp_strategy.sharding.tensor_parallel import hugging_face_plans, plan_layers, weight_split_dim

__all__ = ["ALL_REDUCING_STYLES", "TensorSplits", "all_reduced_activation_bytes", "tensor_splits"]

# The layers whose activations a Colwise -> Rowwise pair all-reduces: a rowwise layer's output in forward, a
# colwise layer's input gradient in backward. The "_rep" variants and sequence parallelism move activations by
# other collectives, which are not estimated (the estimate's note names them).
ALL_REDUCING_STYLES = ("colwise", "rowwise")


@dataclass(frozen=True)
class TensorSplits:
    """``dims``: the dimension each split parameter (by ``id``) is divided along over ``size`` tensor-parallel
    ranks; a parameter not in it is replicated. ``styles``: each split layer's qualified name and style string.
    ``note``: why the split is not known ("" when it is)."""

    size: int
    dims: dict[int, int]
    styles: dict[str, str]
    note: str = ""

    @property
    def known(self) -> bool:
        return not self.note


def tensor_splits(module: nn.Module, size: int, plan: Mapping[str, str] | None = None) -> TensorSplits:
    """How ``size`` tensor-parallel ranks split ``module``: from its DTensors' placements when it is split already,
    else from ``plan`` (or its Hugging Face ``base_model_tp_plan``). Raises ``ValueError`` for a plan style that the
    strategy does not apply."""
    if size == 1:
        return TensorSplits(1, {}, {})
    placed = _placed_splits(module)
    if placed is not None:
        return placed
    if plan is not None:
        plans = [("`tensor_parallel_plan`", module, dict(plan))]
    else:
        plans = [(f"The `base_model_tp_plan` of {type(m).__name__}", m, p) for _, m, p in hugging_face_plans(module)]
    if not plans:
        return TensorSplits(
            size,
            {},
            {},
            note=f"the tensor-parallel split of {type(module).__name__} is not known (no DTensor parameters, no"
            " base_model_tp_plan): parameters counted as replicated over tensor_parallel",
        )
    dims: dict[int, int] = {}
    styles: dict[str, str] = {}
    qualified_names = {id(layer): name for name, layer in module.named_modules()}
    for source, base_model, plan_styles in plans:
        for name, style in plan_layers(base_model, plan_styles, source=source, size=size).items():
            layer = base_model.get_submodule(name)
            styles[qualified_names[id(layer)]] = style
            dim = weight_split_dim(layer, style)
            if dim is None:
                continue
            dims[id(layer.weight)] = dim
            bias = getattr(layer, "bias", None)
            if bias is not None and isinstance(layer, nn.Linear) and dim == 0:  # a Linear's bias follows its outputs
                dims[id(bias)] = 0
    return TensorSplits(size, dims, styles)


def _placed_splits(module: nn.Module) -> TensorSplits | None:
    dims: dict[int, int] = {}
    styles: dict[str, str] = {}
    size = None
    for name, layer in module.named_modules():
        for param_name, param in layer.named_parameters(recurse=False):
            if not isinstance(param, DTensor):
                continue
            names = param.device_mesh.mesh_dim_names or ()
            if TENSOR_PARALLEL_DIM not in names:
                continue
            index = names.index(TENSOR_PARALLEL_DIM)
            size = param.device_mesh.size(index)
            placement = param.placements[index]
            if isinstance(placement, Shard):
                dims[id(param)] = placement.dim
                if param_name == "weight" and isinstance(layer, nn.Linear):
                    # The weight's split names the style: its outputs (rows) or its inputs (columns).
                    styles[name] = "colwise" if placement.dim == 0 else "rowwise"
    if size is None:
        return None
    return TensorSplits(size, dims, styles)


def all_reduced_activation_bytes(layer_activations: Mapping[str, tuple[int, int]], styles: Mapping[str, str]) -> int:
    """Full-size bytes the tensor-parallel ranks all-reduce per micro-batch, from each split layer's traced
    ``(input bytes, output bytes)``: a rowwise layer's output in forward and a colwise layer's input gradient (the
    input's size) in backward, each colwise layer on its own even where several read one input."""
    total = 0
    for name, (inputs, outputs) in layer_activations.items():
        style = styles.get(name)
        if style == "rowwise":
            total += outputs
        elif style == "colwise":
            total += inputs
    return total


def unmodelled_styles(styles: Mapping[str, str]) -> list[str]:
    """The styles in ``styles`` whose collectives (all-gathers, reduce-scatters of activations) are not estimated."""
    return sorted({s for s in styles.values() if s not in ALL_REDUCING_STYLES})
