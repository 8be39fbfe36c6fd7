"""A Lightning checkpoint dict in its parts, the one place that knows them: the module's state, the optimizers'
states, sharded state a callback added, and the rest of the trainer state.

A sharded checkpoint keeps Lightning's own DCP layout (the module under ``"model"``, optimizers under
``"optimizer_0"``, ..., the trainer state in ``meta.pt``), so that
``python -m lightning.pytorch.utilities.consolidate_checkpoint`` reads it too.
"""

from __future__ import annotations

import re
from typing import Any

from torch.distributed.tensor import DTensor

__all__ = [
    "MODEL_KEY",
    "gather_dtensors",
    "holds_dtensor",
    "optimizer_key",
    "optimizer_number",
    "sharded_parts",
    "split_checkpoint",
]

MODEL_KEY = "model"
_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")


def optimizer_key(number: int) -> str:
    """The entry of the ``number``-th optimizer's state in a sharded checkpoint."""
    return f"optimizer_{number}"


def optimizer_number(key: str) -> int | None:
    """The optimizer whose state a sharded checkpoint's top-level entry ``key`` holds; ``None``: no optimizer's."""
    match = _OPTIMIZER_KEY.fullmatch(key)
    return None if match is None else int(match.group(1))


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sharded tensors (model, optimizers) in Lightning's DCP layout, and the rest of the trainer state."""
    rest = dict(checkpoint)
    tensors = {MODEL_KEY: rest.pop("state_dict")}
    optimizer_states = rest.pop("optimizer_states", [])
    if optimizer_states and all("state" not in state for state in optimizer_states):
        # Lightning's stand-in when `configure_optimizers` returns None: its `{}` has nothing for DCP to write, and
        # the trainer state keeps it, or resuming would find no optimizer state at all.
        rest["optimizer_states"] = optimizer_states
    else:
        tensors.update({optimizer_key(i): state for i, state in enumerate(optimizer_states)})
    # Sharded state a callback put in the checkpoint (WeightAveraging's "current_model_state") is saved
    # in shards under its own key, as the module's is: meta.pt would hold rank 0's shards only.
    tensors.update({key: rest.pop(key) for key in list(rest) if holds_dtensor(rest[key])})
    return tensors, rest


def sharded_parts(tensors: dict[str, Any]) -> tuple[Any, dict[int, Any], dict[str, Any]]:
    """:func:`split_checkpoint`'s sharded entries back in their parts: the module's state (``None`` if absent), the
    optimizers' states by number, and the other entries (sharded state a callback added) by key."""
    optimizers: dict[int, Any] = {}
    others: dict[str, Any] = {}
    for key, value in tensors.items():
        number = optimizer_number(key)
        if number is not None:
            optimizers[number] = value
        elif key != MODEL_KEY:
            others[key] = value
    return tensors.get(MODEL_KEY), optimizers, others


def holds_dtensor(value: Any) -> bool:
    if isinstance(value, DTensor):
        return True
    if isinstance(value, dict):
        return any(holds_dtensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_dtensor(v) for v in value)
    return False


def gather_dtensors(value: Any, *, keep: bool) -> Any:
    """``value`` with every DTensor in it (in nested dicts, lists and tuples) replaced by its full tensor on CPU.

    A collective per DTensor: every rank calls it on a ``value`` of the same structure. Ranks that do not
    ``keep`` the result get ``None`` in place of each tensor, so they never hold more than one at a time.
    """
    if isinstance(value, DTensor):
        full = value.full_tensor().cpu()
        return full if keep else None
    if isinstance(value, dict):
        return {k: gather_dtensors(v, keep=keep) for k, v in value.items()} if holds_dtensor(value) else value
    if isinstance(value, (list, tuple)) and holds_dtensor(value):
        return type(value)(gather_dtensors(v, keep=keep) for v in value)
    return value
