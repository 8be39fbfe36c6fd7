"""Tensor parallelism applied for the user: a Hugging Face model's own ``base_model_tp_plan`` through torch's
``parallelize_module``; a module that nothing splits is replicated over the tensor-parallel ranks, with a warning
that names what to write.

A module written for Lightning's ``ModelParallelStrategy`` splits its layers itself in ``configure_model``
(``parallelize_module`` on ``self.device_mesh["tensor_parallel"]``) and comes to the strategy with DTensors; one
that does not, with ``tensor_parallel_size`` above 1, is split here by the plan its Hugging Face model carries
(``config.base_model_tp_plan``: module names with ``*`` wildcards, each with a style string). The strings name
Transformers' own styles; those that a torch style does alike are in :data:`PLAN_STYLES`.

A layer that peft wrapped for LoRA (``q_proj`` is then a ``lora.Linear`` holding the pretrained ``base_layer`` and
the adapters ``lora_A``, ``lora_B``) is split so that its two summands stay alike: ``base_layer(x) + B(A(x)) * s``.
Colwise, the base layer's output is this rank's columns, so ``B`` is split colwise too (its rows are output
columns) and ``A``, which sees the whole input, stays whole. Rowwise, the input is this rank's columns, so ``A`` is
split rowwise (its partial products summed over the ranks, as the base layer's) and ``B``, which then sees the whole
``A(x)``, stays whole. Other peft layers (DoRA and other variants, LoRA of an embedding, other tuners) are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp_strategy._compat import strided_shard_dim
from fsdp_strategy.checkpoint.pretrained import placed_region

__all__ = [
    "PLAN_STYLES",
    "apply_tensor_parallel_plan",
    "check_even_split",
    "hugging_face_plans",
    "is_parallelized",
    "plan_layers",
    "refuse_misgathered_strided_shards",
    "replicated_module_warning",
    "weight_split_dim",
]

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
        # On the class: peft's PeftModel and LoraModel hand out their wrapped model's attributes as their own.
        if not plan or not hasattr(type(module), "base_model_prefix"):
            continue
        if any(outer == "" or name.startswith(outer + ".") for outer, _, _ in found):
            continue
        found.append((name, getattr(module, "base_model", module), dict(plan)))
    return found


def replicated_module_warning(model: nn.Module, size: int, data_parallel_size: int) -> str | None:
    """The warning for ``model`` under ``size`` tensor-parallel ranks when nothing splits it: its ``configure_model``
    left no DTensor and it holds no Hugging Face model with a ``base_model_tp_plan``. It is then replicated over the
    tensor-parallel ranks (they read the same batches, so their gradients are the same) and sharded over the
    ``data_parallel_size`` data-parallel ranks only, as under Lightning's ``ModelParallelStrategy``. ``None`` where
    something splits it, or ``size`` is 1."""
    if size <= 1 or is_parallelized(model) or hugging_face_plans(model):
        return None
    sharded = (
        f"sharded over the {data_parallel_size} data-parallel ranks only"
        if data_parallel_size > 1
        else "not sharded (the data-parallel dimension has 1 rank)"
    )
    return (
        f"`tensor_parallel_size={size}` with no tensor-parallel plan: {type(model).__name__} holds no DTensor from"
        " `configure_model()` and no Hugging Face model with a `config.base_model_tp_plan`, so it is replicated over"
        f" the {size} tensor-parallel ranks (each computes the same batches) and {sharded}. To shard it over all"
        f" ranks, set {_NO_TENSOR_PARALLELISM}; to split it, split its layers in the LightningModule's"
        " `configure_model()`, as for Lightning's ModelParallelStrategy:"
        ' `parallelize_module(layer, self.device_mesh["tensor_parallel"], {"proj_in": ColwiseParallel(),'
        ' "proj_out": RowwiseParallel()})` (torch.distributed.tensor.parallel).'
    )


def apply_tensor_parallel_plan(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Splits each Hugging Face model inside ``model`` over ``mesh`` by its ``base_model_tp_plan``; returns the
    names of the models split, none when ``model`` holds no such plan (it is left whole:
    :func:`replicated_module_warning`). Raises ``ValueError`` before anything is split when a plan holds a style
    string that :data:`PLAN_STYLES` does not, names no module, splits a peft layer other than plain LoRA, or cannot
    be split evenly over ``mesh`` (:func:`check_even_split`)."""
    size = mesh.size()
    plans = hugging_face_plans(model)
    split = []
    for name, base_model, plan in plans:
        source = f"The `base_model_tp_plan` of {type(base_model).__name__} ({name or 'the module'})"
        layers = plan_layers(base_model, plan, source=source, size=size)
        if not layers:
            # parallelize_module only warns about a pattern that names no module: the model would train whole on
            # every tensor-parallel rank.
            raise ValueError(
                f"`tensor_parallel_size={size}`: the `base_model_tp_plan` of {type(base_model).__name__}"
                f" ({name or 'the module'}) names no module of it ({list(plan)[:3]} ...). Split the model in"
                f" `configure_model()` with `parallelize_module`, or set {_NO_TENSOR_PARALLELISM}."
            )
        check_even_split(base_model, layers, size)
        split.append((base_model, {layer: PLAN_STYLES[style]() for layer, style in layers.items()}))
    for base_model, styles in split:  # every plan checked before any model is split
        frozen = {name for name, param in base_model.named_parameters() if not param.requires_grad}
        parallelize_module(base_model, mesh, styles)
        # torch 2.9's styles wrap each split weight in a new nn.Parameter, trainable by default: a frozen base
        # would train (later releases keep the flag).
        for name, param in base_model.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
    return [name for name, _, _ in plans]


# A user of strategy="fsdp2_tp" never wrote tensor_parallel_size.
_NO_TENSOR_PARALLELISM = '`tensor_parallel_size=1` (`strategy="fsdp2"` in place of `"fsdp2_tp"`)'


def plan_layers(base_model: nn.Module, plan: Mapping[str, str], *, source: str, size: int) -> dict[str, str]:
    """The layers of ``base_model`` that ``plan`` splits, by name, each with its style string, as the strategy
    applies the plan: ``*`` stands for one part of a name (as in ``parallelize_module``), a later pattern wins over an
    earlier one, and a peft LoRA layer is replaced by its parts (see the module docstring). ``source`` names the plan
    and ``size`` the tensor-parallel ranks in errors. Raises ``ValueError`` for a style that :data:`PLAN_STYLES` does
    not hold or a peft layer the strategy does not split."""
    for pattern, style in plan.items():
        if style not in PLAN_STYLES:
            raise ValueError(
                f"{source} splits {pattern!r} as {style!r}, which this strategy does not apply; it applies"
                f" {', '.join(repr(s) for s in PLAN_STYLES)}. Split the model in `configure_model()` with"
                " `parallelize_module` instead."
            )
    named = {name: style for pattern, style in plan.items() for name in _matching(base_model, pattern)}
    layers: dict[str, str] = {}
    for name, style in named.items():
        layers.update(_layer_parts(name, base_model.get_submodule(name), style, size))
    return layers


# Where a style splits a layer's weight, as torch's ColwiseParallel/RowwiseParallel do: nn.Linear keeps
# (out_features, in_features), nn.Embedding (num_embeddings, embedding_dim). A Linear's bias is split with its outputs.
_WEIGHT_DIM = {
    ("colwise", nn.Linear): 0,
    ("rowwise", nn.Linear): 1,
    ("colwise", nn.Embedding): 1,
    ("rowwise", nn.Embedding): 0,
}


def weight_split_dim(layer: nn.Module, style: str) -> int | None:
    """The dimension of ``layer.weight`` that ``style`` splits; ``None`` when it splits no weight of this layer
    (sequence parallelism keeps norms whole)."""
    kind = style.removesuffix("_rep")
    return next((dim for (s, cls), dim in _WEIGHT_DIM.items() if s == kind and isinstance(layer, cls)), None)


# Transformers' attention reshapes each rank's projection into its whole heads: the head counts must split evenly.
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


def check_even_split(base_model: nn.Module, layers: Mapping[str, str], size: int) -> None:
    """Raises ``ValueError`` when ``size`` tensor-parallel ranks cannot split ``base_model`` evenly: a head count of
    its config (when a layer is split colwise) or the split dimension of a layer of ``layers`` (name -> style, as
    :func:`plan_layers` gives). torch would fail later, in the first forward, with a shape error that names neither.
    The sizes offered divide every count checked."""
    counts: list[tuple[str, int]] = []
    if any(style.startswith("colwise") for style in layers.values()):
        config = getattr(base_model, "config", None)
        counts += [(f"config.{field}", getattr(config, field, None)) for field in _HEAD_COUNTS]
    for name, style in layers.items():
        layer = base_model.get_submodule(name)
        dim = weight_split_dim(layer, style)
        if dim is not None:
            counts.append((f"{name}.weight dimension {dim} ({style})", layer.weight.shape[dim]))
    counts = [(what, count) for what, count in counts if isinstance(count, int) and count > 0]
    uneven = [(what, count) for what, count in counts if count % size]
    if uneven:
        what, count = uneven[0]
        common = math.gcd(*(count for _, count in counts))
        divisors = [d for d in range(1, common + 1) if common % d == 0]
        raise ValueError(
            f"`tensor_parallel_size={size}` does not split {type(base_model).__name__} evenly: {what} is {count}"
            f"{f' (and {len(uneven) - 1} more)' if len(uneven) > 1 else ''}. Use a tensor_parallel_size that divides"
            f" every split dimension and head count ({', '.join(map(str, divisors))}), or split the model yourself in"
            " `configure_model()`."
        )


def _matching(model: nn.Module, pattern: str) -> list[str]:
    """The names of ``model``'s modules that ``pattern`` names, ``*`` standing for one part of a name, as
    ``parallelize_module`` reads a plan."""
    parts = pattern.split(".")
    return [
        name
        for name, _ in model.named_modules()
        if name and len(name.split(".")) == len(parts) and all(map(fnmatchcase, name.split("."), parts))
    ]


def _layer_parts(name: str, layer: nn.Module, style: str, size: int) -> dict[str, str]:
    """The layers, by name, that split the plan's ``layer`` as ``style``: the layer itself, or the parts of a peft
    LoRA layer (see the module docstring), each with that style."""
    if not hasattr(layer, "base_layer"):
        return {name: style}
    part = "lora_B" if style.startswith("colwise") else "lora_A"
    adapters = getattr(layer, part, None)
    plain_lora = (
        style != "sequence_parallel"
        and isinstance(layer.base_layer, nn.Linear)
        and isinstance(adapters, nn.ModuleDict)
        and all(isinstance(adapter, nn.Linear) for adapter in adapters.values())
        # DoRA and the other variants change how the summands combine (older peft kept DoRA's magnitudes apart).
        and not getattr(layer, "lora_variant", None)
        and not getattr(layer, "lora_magnitude_vector", None)
    )
    if not plain_lora:
        raise ValueError(
            f"`tensor_parallel_size={size}`: the plan splits {name!r} as {style!r}, and peft wrapped it in"
            f" {type(layer).__name__}, which this strategy splits only as a plain LoRA layer of an nn.Linear (no DoRA"
            f" or other variant). Leave this layer out of the peft config's `target_modules`, or set"
            f" {_NO_TENSOR_PARALLELISM}: adapters rarely need tensor parallelism."
        )
    return {f"{name}.base_layer": style, **{f"{name}.{part}.{adapter}": style for adapter in adapters}}


def refuse_misgathered_strided_shards(model: nn.Module) -> None:
    """Raises ``ValueError`` when this torch cannot put back together a parameter of ``model`` that tensor
    parallelism split and FSDP2 then cut unevenly within each piece (``_StridedShard``): torch 2.9 misplaces its rows
    in ``full_tensor()`` (pytorch/pytorch#163843), which full checkpoints, exports and whole-parameter hooks read.
    Each such layout is probed once, on a tensor of its shape along the cut dimension with known values."""
    probed: dict[tuple, bool] = {}
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        for dim, ranks in _strided_cuts(param):
            if param.shape[dim] % ranks == 0:
                continue
            layout = (dim, param.shape[dim], param.device_mesh, tuple(param.placements))
            if layout not in probed:
                probed[layout] = _gathers_whole(param, dim)
            if not probed[layout]:
                raise ValueError(
                    f"torch {torch.__version__} gathers {name} wrongly: its dimension {dim} ({param.shape[dim]}) is"
                    f" split over {ranks} ranks, tensor_parallel first and data_parallel unevenly within each piece,"
                    " and this torch misplaces such rows when it puts the tensor back together (full checkpoints,"
                    " Hugging Face exports and whole parameters in hooks would read them; pytorch/pytorch#163843)."
                    f" Upgrade torch (2.10 and later gather it correctly), or choose sizes where {ranks} divides"
                    f" {param.shape[dim]} (tensor_parallel_size x the data-parallel shards)."
                )


def _strided_cuts(param: DTensor) -> list[tuple[int, int]]:
    """``(dim, ranks)`` of each tensor dimension that a strided shard cuts: all the mesh ranks that split it."""
    cuts = []
    for dim in {strided_shard_dim(p) for p in param.placements} - {None}:
        splitting = [i for i, p in enumerate(param.placements) if strided_shard_dim(p) == dim or p == Shard(dim)]
        cuts.append((dim, math.prod(param.device_mesh.size(i) for i in splitting)))
    return cuts


def _gathers_whole(param: DTensor, dim: int) -> bool:
    # Collective on param's mesh: every rank has the same parameters, so every rank probes the same layouts in turn.
    shape = [1] * param.dim()
    shape[dim] = param.shape[dim]
    whole = torch.arange(param.shape[dim], dtype=torch.float32, device=param.device_mesh.device_type).reshape(shape)
    local = whole[placed_region(whole.shape, param.device_mesh, param.placements)]
    probe = DTensor.from_local(local, param.device_mesh, param.placements, shape=whole.shape, stride=whole.stride())
    return torch.equal(probe.full_tensor(), whole)
