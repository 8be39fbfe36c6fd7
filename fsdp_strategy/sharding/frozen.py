"""Frozen parameters kept in a lower storage dtype than the trainable ones (``frozen_dtype``), as QLoRA-style
recipes keep their base model.

A parameter with ``requires_grad=False`` gets no gradient and no optimizer state under FSDP2 (as under DDP), so
its storage is all it costs; ``"bfloat16"``/``"float16"`` halve that, ``"nf4"`` quantizes frozen ``nn.Linear``
weights to torchao's 4-bit NF4 tensor (about 0.52 bytes per element), which FSDP2 shards and gathers as its own
tensor subclass (as torchtune's QLoRA does). Trainable parameters keep the dtype they were built with.

The conversion runs before ``fully_shard``: FSDP2 shards a parameter in the dtype it finds, and on torch 2.13
one unit may hold fp32 trainable and bf16 frozen parameters together (a LoRA layer inside a frozen block), each
gathered in its own dtype; under ``*-mixed`` the policy's ``param_dtype`` then casts only the fp32 ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "FROZEN_DTYPES",
    "NF4_REQUIREMENT",
    "frozen_cast_dtype",
    "nf4_available",
    "nf4_fits",
    "store_frozen",
    "torchao_to_nf4",
]

_CASTS = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FROZEN_DTYPES = (*_CASTS, "nf4")
NF4_REQUIREMENT = "torchao's NF4 tensor: `pip install torchao` (or `pip install fsdp-strategy[nf4]`)"
# torchao's NF4 layout: each block of 64 values shares a scale, and the scales are themselves quantized in
# blocks of 256; a shard must hold whole blocks of both.
_NF4_BLOCK = 64
_NF4_SCALER_BLOCK = 256


def frozen_cast_dtype(frozen_dtype: str | None) -> torch.dtype | None:
    """The dtype frozen floating-point parameters are cast to; ``None`` for "as built" and for ``"nf4"``."""
    return _CASTS.get(frozen_dtype) if frozen_dtype is not None else None


def torchao_to_nf4() -> Callable[[torch.Tensor], Any]:
    """torchao's ``to_nf4``; raises ``ImportError`` naming the install when torchao is missing or does not import
    with this torch (each torchao release is built for the torch releases of its time)."""
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(f"`frozen_dtype='nf4'` needs {NF4_REQUIREMENT}; torchao is not installed here.")
    errors = []
    for module_name in ("torchao.dtypes.nf4tensor", "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"):
        try:
            return importlib.import_module(module_name).to_nf4
        except ImportError as error:
            errors.append(f"{module_name}: {error}")
    raise ImportError(
        f"`frozen_dtype='nf4'` needs {NF4_REQUIREMENT}, in a release that imports with torch {torch.__version__};"
        f" the torchao installed here does not ({'; '.join(errors)})."
    )


def nf4_available() -> bool:
    try:
        torchao_to_nf4()
    except ImportError:
        return False
    return True


def nf4_fits(shape: tuple[int, ...], shards: int) -> bool:
    """Whether a weight of ``shape`` quantizes to NF4 and splits evenly into ``shards`` (NF4 cannot be padded)."""
    numel = math.prod(shape)
    quantization_factors, rest = divmod(numel, _NF4_BLOCK * _NF4_SCALER_BLOCK)
    return len(shape) == 2 and rest == 0 and quantization_factors % shards == 0 and shape[0] % shards == 0


def store_frozen(model: nn.Module, frozen_dtype: str, *, shards: int) -> int:
    """Frozen floating-point parameters of ``model`` converted to ``frozen_dtype`` in place; returns how many.

    A cast keeps each ``nn.Parameter`` object (its ``.data`` changes; a tensor-parallel DTensor's contents are
    swapped, as assigning its ``.data`` changes the dtype it reports and not its local tensor's), so tied weights,
    optimizer parameter groups made before sharding and the snapshot of the module stay valid. ``"nf4"`` converts
    the weights of frozen ``nn.Linear`` layers that :func:`nf4_fits` ``shards`` and that no other module shares; other
    frozen parameters stay as built.
    """
    if frozen_dtype == "nf4":
        return _quantize_linear_weights(model, shards)
    dtype = _CASTS[frozen_dtype]
    converted = 0
    for param in {id(p): p for p in model.parameters()}.values():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            if isinstance(param, DTensor):
                torch.utils.swap_tensors(param, nn.Parameter(param.detach().to(dtype), requires_grad=False))
            else:
                param.data = param.data.to(dtype)
            converted += 1
    return converted


def _quantize_linear_weights(model: nn.Module, shards: int) -> int:
    to_nf4 = torchao_to_nf4()
    if shards == 1:
        # FSDP2 gathers a tensor subclass through its own all-gather hooks only across ranks; torchao's NF4 tensor
        # then fails inside its post-all-gather hook on a mesh of one.
        raise ValueError(
            "`frozen_dtype='nf4'` needs 2 or more ranks to shard over; got a shard group of 1. On one process, train"
            ' without FSDP2 (`strategy="auto"`) with the frozen weights converted by torchao\'s `to_nf4`.'
        )
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    converted = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or not isinstance(weight, nn.Parameter) or weight.requires_grad:
            continue
        if owners[id(weight)] == 1 and weight.is_floating_point() and nf4_fits(tuple(weight.shape), shards):
            module.weight = nn.Parameter(to_nf4(weight.detach()), requires_grad=False)
            converted += 1
    return converted
