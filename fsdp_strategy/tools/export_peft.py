"""A ``peft`` run's adapters as ``PeftModel.save_pretrained`` writes them, from any checkpoint of the run (adapter,
sharded or full), in one process: ``adapter_model.safetensors`` and ``adapter_config.json``, which
``PeftModel.from_pretrained(base_model, out_dir)`` loads. An adapter other than ``"default"`` goes into a folder of
its own name inside ``out_dir``, as ``save_pretrained`` puts it.

What to write comes from the checkpoint's record of the adapters (:mod:`~fsdp_strategy.checkpoint.peft_record`,
made by the strategy at each save): their configs, and which of the module's tensors each adapter has under which
name. Only those tensors are read, each in blocks (:mod:`~fsdp_strategy.checkpoint.weights`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fsdp_strategy.checkpoint.peft_record import PEFT_KEY
from fsdp_strategy.checkpoint.weights import WeightEntry, read_model_weights
from fsdp_strategy.sizes import format_bytes
from fsdp_strategy.tools.export import write_atomically, write_safetensors_file
from fsdp_strategy.tools.progress import progress_bar

__all__ = ["PeftExport", "export_peft"]

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"


@dataclass(frozen=True)
class PeftExport:
    """What :func:`export_peft` wrote (the ``consolidate`` command prints it)."""

    path: Path
    adapters: list[str]
    tensors: int
    tensor_bytes: int

    def describe(self) -> str:
        names = ", ".join(repr(name) for name in self.adapters)
        return (
            f"{self.path}: the peft adapter{'s' if len(self.adapters) != 1 else ''} {names}, {self.tensors} tensors,"
            f" {format_bytes(self.tensor_bytes)} ({WEIGHTS_NAME} and {CONFIG_NAME})"
        )


@dataclass(frozen=True)
class _Adapter:
    name: str
    folder: Path
    entries: list[WeightEntry]
    config: dict[str, Any]


def export_peft(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    weights_only: bool = True,
) -> PeftExport:
    """Writes the adapters recorded in ``checkpoint`` to ``out_dir`` as ``PeftModel.save_pretrained`` does.

    Args:
        checkpoint: a checkpoint that ``FSDP2Strategy`` saved from a module holding a ``peft`` model (any
            ``state_dict_type``; a directory, a URL or a file).
        out_dir: the folder to write; created if needed.
        prefix: the LightningModule attribute of the ``peft`` model (``"model."``), needed only when the module
            holds several.
        overwrite: replace the adapter files already in ``out_dir`` (otherwise that is an error).
        progress: a progress bar over the tensors on stderr (with ``tqdm``).
        weights_only: as for :func:`~fsdp_strategy.consolidate_checkpoint`.

    Raises:
        ValueError: the checkpoint records no adapters, or not those asked for, or lacks their tensors;
            :class:`~fsdp_strategy.CheckpointError` for a damaged one. FileExistsError: files in ``out_dir``.
    """
    weights = read_model_weights(checkpoint, weights_only=weights_only)
    adapters = _adapters(weights.peft_adapters, prefix, checkpoint, {e.name: e for e in weights.entries}, Path(out_dir))
    for adapter in adapters:
        _check_output(adapter.folder, overwrite)
    total = sum(len(adapter.entries) for adapter in adapters)
    bar = progress_bar(total, desc="Exporting") if progress else None
    try:
        for adapter in adapters:
            adapter.folder.mkdir(parents=True, exist_ok=True)
            write_safetensors_file(adapter.folder / WEIGHTS_NAME, adapter.entries, bar)
            config = json.dumps(adapter.config, indent=2, sort_keys=True).encode() + b"\n"
            write_atomically(adapter.folder / CONFIG_NAME, config)
    finally:
        if bar is not None:
            bar.close()
    entries = [entry for adapter in adapters for entry in adapter.entries]
    return PeftExport(Path(out_dir), [a.name for a in adapters], len(entries), sum(e.nbytes for e in entries))


def _adapters(
    record: dict[str, Any] | None, prefix: str | None, checkpoint: Any, saved: dict[str, WeightEntry], target: Path
) -> list[_Adapter]:
    if not record:
        raise ValueError(
            f"'{checkpoint}' records no peft adapters: it was not saved by FSDP2Strategy from a LightningModule"
            f" holding a peft model (its checkpoints hold them under '{PEFT_KEY}')."
        )
    if prefix is None and len(record) > 1:
        raise ValueError(
            f"'{checkpoint}' holds several peft models ({', '.join(map(repr, record))}): pass `prefix` (--prefix)"
            " to choose one."
        )
    chosen = next(iter(record)) if prefix is None else prefix
    if chosen not in record:
        raise ValueError(
            f"`prefix` {prefix!r} names no peft model of '{checkpoint}'; it holds {', '.join(map(repr, record))}."
        )
    adapters = []
    for name, adapter in record[chosen].items():
        if adapter["weights"] is None:
            kind = adapter["config"].get("peft_type")
            raise ValueError(
                f"The peft adapter {name!r} of '{checkpoint}' ({kind}) keeps weights outside the module's state:"
                " export it with peft's save_pretrained from the trained module."
            )
        missing = [key for key in adapter["weights"] if key not in saved]
        if missing:
            raise ValueError(
                f"'{checkpoint}' lacks {len(missing)} tensors of the peft adapter {name!r}, such as {missing[0]!r}."
            )
        entries = [replace(saved[key], name=peft_name) for key, peft_name in adapter["weights"].items()]
        folder = target if name == "default" else target / name
        adapters.append(_Adapter(name, folder, entries, adapter["config"]))
    return adapters


def _check_output(folder: Path, overwrite: bool) -> None:
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file; give the folder to write the adapter into")
    taken = [name for name in (WEIGHTS_NAME, CONFIG_NAME) if (folder / name).exists()]
    if taken and not overwrite:
        raise FileExistsError(
            f"{folder} already holds {', '.join(taken)}; pass overwrite=True (--overwrite) to replace them"
        )
