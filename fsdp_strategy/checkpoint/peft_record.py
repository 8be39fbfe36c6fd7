"""The adapters of a ``peft`` model held by a LightningModule, recorded in each checkpoint (under
:data:`PEFT_KEY`, plain data) so that ``fsdp-strategy consolidate --format peft`` can write what ``PeftModel
.save_pretrained`` writes from any checkpoint of the run, without the model.

For each adapter the record holds its config (``adapter_config.json``'s contents, as ``save_pretrained`` writes
them) and the name of each of its tensors in the checkpoint next to the name peft saves it under. Those names are
peft's own: :func:`peft.get_peft_model_state_dict` picks the adapter's entries of the module's state and names them
(the adapter name dropped), given a state of stand-ins, so nothing is gathered or copied.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

__all__ = ["PEFT_KEY", "peft_record"]

PEFT_KEY = "peft_adapters"


def peft_record(module: nn.Module) -> dict[str, Any] | None:
    """``{"<attribute path>.": {"<adapter name>": {"config": {...}, "weights": {checkpoint key: peft key}}}}``
    for each outermost submodule of ``module`` with a ``peft_config`` (a ``PeftModel``, or a transformers model
    with adapters added); ``None`` when there is none."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        if _holds_adapters(child) and not any(name.startswith(outer) for outer, _ in found):
            found.append((f"{name}." if name else "", child))
    if not found:
        return None
    state = nn.Module.state_dict(module)
    record: dict[str, Any] = {}
    for prefix, peft_module in found:
        try:
            record[prefix] = _adapters(peft_module, prefix, state)
        except Exception as error:  # noqa: BLE001  (a record that cannot be made must not fail the save)
            rank_zero_warn(
                f"The checkpoints of this run hold no record of the peft adapters of '{prefix.rstrip('.')}', so"
                f" `fsdp-strategy consolidate --format peft` cannot export them: {type(error).__name__}: {error}"
            )
    return record or None


def _holds_adapters(module: nn.Module) -> bool:
    configs = getattr(module, "peft_config", None)  # peft's configs by adapter name
    return isinstance(configs, dict) and bool(configs) and all(hasattr(c, "peft_type") for c in configs.values())


def _adapters(peft_module: nn.Module, prefix: str, state: dict[str, Any]) -> dict[str, Any]:
    """Each adapter's config and its tensors' names (``None`` where peft saves tensors not in the module's state)."""
    from peft import get_peft_model_state_dict

    # A stand-in of its own for each entry, found again by identity in what peft returns, whatever names peft gives
    # them. Meta tensors of the global shape: peft (0.22) gathers DTensor entries with full_tensor(), which would
    # make new tensors (and a collective on one rank's save); a meta tensor holds no memory and is never gathered.
    stand_ins = {key[len(prefix) :]: _stand_in(value) for key, value in state.items() if key.startswith(prefix)}
    keys = {id(value): prefix + key for key, value in stand_ins.items()}
    adapters = {}
    for adapter, config in peft_module.peft_config.items():
        # save_embedding_layers=False: "auto" would look the base model up on the Hugging Face Hub at each save.
        picked = get_peft_model_state_dict(
            peft_module, state_dict=stand_ins, adapter_name=adapter, save_embedding_layers=False
        )
        weights = {keys[id(value)]: name for name, value in picked.items() if id(value) in keys}
        unsupported = len(weights) != len(picked)  # entries peft made itself (prompt learning's embeddings)
        adapters[adapter] = {"config": _config(config, peft_module), "weights": None if unsupported else weights}
    return adapters


def _stand_in(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty(value.shape, dtype=value.dtype, device="meta")


def _config(config: Any, peft_module: nn.Module) -> dict[str, Any]:
    """``adapter_config.json``'s contents, as ``save_pretrained`` writes them: for inference, naming the base."""
    saved = copy.deepcopy(config)
    saved.inference_mode = True
    if getattr(saved, "base_model_name_or_path", None) is None:
        base = peft_module.get_base_model() if hasattr(peft_module, "get_base_model") else peft_module
        saved.base_model_name_or_path = getattr(base, "name_or_path", None) or None
    as_dict = saved.to_dict()
    if getattr(saved, "task_type", None) is None and hasattr(peft_module, "get_base_model"):
        # What AutoPeftModel builds the base with, as save_pretrained names it for a config without a task type.
        base_class = type(peft_module.get_base_model())
        as_dict["auto_mapping"] = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    # Plain JSON data (sets as sorted lists, enums as their values): the record loads with weights_only=True.
    return json.loads(json.dumps(as_dict, default=_plain))


def _plain(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)
