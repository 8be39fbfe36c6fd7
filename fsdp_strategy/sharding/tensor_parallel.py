"""Tensor parallelism applied for the user: a Hugging Face model's own ``base_model_tp_plan`` through torch's
``parallelize_module``, or an error that names what to write.

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

from collections.abc import Callable
from fnmatch import fnmatchcase

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

__all__ = ["PLAN_STYLES", "apply_tensor_parallel_plan", "check_even_split", "hugging_face_plans", "is_parallelized"]

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
        styles: dict[str, ParallelStyle] = {}
        split_layers: dict[str, str] = {}
        for pattern, style in plan.items():
            if style not in PLAN_STYLES:
                raise ValueError(
                    f"The `base_model_tp_plan` of {type(base_model).__name__} ({name or 'the module'}) splits"
                    f" {pattern!r} as {style!r}, which this strategy does not apply; it applies"
                    f" {', '.join(repr(s) for s in PLAN_STYLES)}. Split the model in `configure_model()` with"
                    " `parallelize_module` instead."
                )
            for layer in _matching(base_model, pattern):
                styles.update(_layer_styles(layer, base_model.get_submodule(layer), style, mesh.size()))
                split_layers[layer] = style
        if not styles:
            # parallelize_module only warns about a pattern that names no module: the model would train whole on
            # every tensor-parallel rank.
            raise ValueError(
                f"`tensor_parallel_size={mesh.size()}`: the `base_model_tp_plan` of {type(base_model).__name__}"
                f" ({name or 'the module'}) names no module of it ({list(plan)[:3]} ...). Split the model in"
                " `configure_model()` with `parallelize_module`, or set `tensor_parallel_size=1`."
            )
        check_even_split(base_model, split_layers, mesh.size())
        parallelize_module(base_model, mesh, styles)
    return [name for name, _, _ in plans]


# Transformers' attention reshapes each rank's projection into its whole heads: the head counts must split evenly.
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


def check_even_split(base_model: nn.Module, split_layers: dict[str, str], size: int) -> None:
    """Raises ``ValueError`` when ``size`` tensor-parallel ranks cannot split ``base_model`` evenly: a head count of
    its config (when a layer is split colwise) or the split dimension of a layer of ``split_layers`` (name ->
    plan style). torch would fail later, in the first forward, with a shape error that names neither."""
    uneven: list[tuple[str, int]] = []
    if any(style.startswith("colwise") for style in split_layers.values()):
        config = getattr(base_model, "config", None)
        for field in _HEAD_COUNTS:
            count = getattr(config, field, None)
            if isinstance(count, int) and count % size:
                uneven.append((f"config.{field}", count))
    for name, style in split_layers.items():
        layer = base_model.get_submodule(name)
        weight = getattr(getattr(layer, "base_layer", layer), "weight", None)
        if weight is None or weight.dim() != 2 or style == "sequence_parallel":
            continue
        # nn.Linear holds (out, in): colwise splits the outputs; nn.Embedding holds (rows, dim): rowwise splits rows.
        dim = int(style.startswith("colwise")) if isinstance(layer, nn.Embedding) else int(style.startswith("rowwise"))
        if weight.shape[dim] % size:
            uneven.append((f"{name}.weight dimension {dim} ({style})", weight.shape[dim]))
    if uneven:
        what, count = uneven[0]
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise ValueError(
            f"`tensor_parallel_size={size}` does not split {type(base_model).__name__} evenly: {what} is {count}"
            f"{f' (and {len(uneven) - 1} more)' if len(uneven) > 1 else ''}. Use a tensor_parallel_size that divides"
            f" it ({', '.join(map(str, divisors))}), or split the model yourself in `configure_model()`."
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


def _layer_styles(name: str, layer: nn.Module, style: str, size: int) -> dict[str, ParallelStyle]:
    """The styles that split the plan's ``layer`` as ``style``: the layer itself, or the parts of a peft LoRA
    layer (see the module docstring)."""
    if not hasattr(layer, "base_layer"):
        return {name: PLAN_STYLES[style]()}
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
            f"`tensor_parallel_size={size}`: the `base_model_tp_plan` splits {name!r} as {style!r}, and peft wrapped"
            f" it in {type(layer).__name__}, which this strategy splits only as a plain LoRA layer of an nn.Linear"
            " (no DoRA or other variant). Set `tensor_parallel_size=1` (adapters rarely need tensor parallelism),"
            " or leave this layer out of the peft config's `target_modules`."
        )
    return {
        f"{name}.base_layer": PLAN_STYLES[style](),
        **{f"{name}.{part}.{adapter}": PLAN_STYLES[style]() for adapter in adapters},
    }
