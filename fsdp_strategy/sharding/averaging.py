"""Lightning's ``WeightAveraging`` callback (EMA, and its other averages) on a sharded module.

The callback builds its ``AveragedModel`` in ``setup()``, a deep copy of the LightningModule made before the
strategy shards it. :class:`ShardedAverages` then shards that copy the way the module is sharded: every
averaged parameter becomes a DTensor on the module's mesh with the module's placements, so each rank keeps
1/N of the average, and everything the callback does with it works on the shards without communication
(``AveragedModel.update_parameters`` is elementwise; swapping weights in for validation copies shard into
shard; its ``state_dict`` is sharded like the module's and is saved with the shards). Buffers stay whole,
as the module's do. The copy keeps the dtype and device Lightning gave it, so the average is what DDP's is.

Lightning's ``StochasticWeightAveraging`` is refused: besides a full copy of the module it replaces the
learning-rate scheduler and adds an epoch at the end of training that recomputes BatchNorm statistics.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.swa_utils import AveragedModel
from torch.utils.hooks import RemovableHandle

from fsdp_strategy._compat import averaged_model_of
from fsdp_strategy.sharding.deferred_init import has_meta_tensors
from fsdp_strategy.sharding.parallelize import load_full_tensors_into_shards

__all__ = [
    "ShardedAverages",
    "refuse_meta_module",
    "refuse_stochastic_weight_averaging",
    "shard_like",
    "unshard",
]


def refuse_stochastic_weight_averaging(callbacks: Iterable[Any]) -> None:
    """Raises ``MisconfigurationException`` for Lightning's ``StochasticWeightAveraging`` callback."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    for callback in callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            raise MisconfigurationException(
                "StochasticWeightAveraging does not support sharded models: it keeps a full copy of the module,"
                " replaces the learning-rate scheduler and adds an epoch that recomputes BatchNorm statistics"
                " (Lightning's FSDPStrategy refuses it too). Use `lightning.pytorch.callbacks.WeightAveraging`,"
                " which FSDP2Strategy keeps sharded: `WeightAveraging()` averages the weights equally, as SWA does;"
                " override its `should_update()` to choose from which step or epoch on."
            )


def refuse_meta_module(callbacks: Iterable[Any], module: nn.Module) -> None:
    """Raises ``ValueError`` when a ``WeightAveraging`` callback would copy a module that holds meta tensors.

    Lightning's callback copies the module in its ``setup()``, before the strategy materializes it, and
    ``AveragedModel`` fails there with "Cannot copy out of meta tensor" (the Trainer's teardown then fails too).
    """
    averaging = _weight_averaging_callbacks(callbacks)
    if averaging and has_meta_tensors(module):
        raise ValueError(
            f"{type(averaging[0]).__name__} cannot average a module built on the meta device"
            " (`trainer.init_module(empty_init=True)`): Lightning's callback copies the module in its `setup()`,"
            " before FSDP2Strategy materializes and shards it, and a meta tensor has no values to copy. Build the"
            " module without `empty_init=True` (the callback holds a full copy until the strategy shards it"
            " anyway), or train without the callback."
        )


def _weight_averaging_callbacks(callbacks: Iterable[Any]) -> list[Any]:
    from lightning.pytorch import callbacks as lightning_callbacks

    averaging = getattr(lightning_callbacks, "WeightAveraging", None)  # Lightning >= 2.6
    return [callback for callback in callbacks if averaging is not None and isinstance(callback, averaging)]


class ShardedAverages:
    """The averaged copies of the ``WeightAveraging`` callbacks in ``callbacks``, sharded like ``model``."""

    def __init__(self, averages: list[AveragedModel], hooks: list[RemovableHandle]) -> None:
        self.averages = averages
        self._hooks = hooks

    @classmethod
    def attach(cls, callbacks: Iterable[Any], model: nn.Module) -> ShardedAverages:
        averages = [a for a in map(averaged_model_of, _weight_averaging_callbacks(callbacks)) if a is not None]
        hooks: list[RemovableHandle] = []
        for average in averages:
            shard_like(average.module, model)
            # Checkpoint files hold the average as full tensors (DDP's, or state_dict_type="full").
            hooks += load_full_tensors_into_shards(average.module)
        return cls(averages, hooks)

    def close(self) -> None:
        """Gives the averages back as plain full tensors (the module is given back after a stage too)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for average in self.averages:
            unshard(average.module)
        self.averages = []


def shard_like(copy: nn.Module, model: nn.Module) -> None:
    """Replaces each full parameter of ``copy`` by a DTensor laid out as ``model``'s parameter of that name.

    Each rank keeps its own shard of its own copy's values (no communication), in the copy's dtype and on its
    device. Parameters shared between modules stay shared; ones already sharded are left as they are.
    """
    sharded = dict(model.named_parameters())
    replacements: dict[int, nn.Parameter] = {}
    for name, param in copy.named_parameters():
        like = sharded.get(name)
        if like is None:
            raise ValueError(
                f"The averaged copy of the module has a parameter {name!r} that the sharded module lacks; the"
                " module changed its parameters after WeightAveraging copied it (in `setup()`). Build every"
                " layer in `__init__` or `configure_model()`."
            )
        if isinstance(param, DTensor) or not isinstance(like, DTensor):
            continue
        if param.shape != like.shape:
            raise ValueError(
                f"The averaged copy's parameter {name!r} has shape {tuple(param.shape)}, the sharded module's"
                f" {tuple(like.shape)}: the module changed after WeightAveraging copied it (in `setup()`)."
            )
        local = distribute_tensor(param.detach(), like.device_mesh, like.placements, src_data_rank=None)
        shard = local.to(device=param.device, dtype=param.dtype)
        replacements[id(param)] = nn.Parameter(shard, requires_grad=param.requires_grad)
    _replace_parameters(copy, replacements)


def unshard(copy: nn.Module) -> None:
    """Replaces each DTensor parameter of ``copy`` by its full tensor (a collective: every rank calls it)."""
    replacements = {
        id(param): nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad)
        for param in copy.parameters()
        if isinstance(param, DTensor)
    }
    _replace_parameters(copy, replacements)


def _replace_parameters(root: nn.Module, replacements: dict[int, nn.Parameter]) -> None:
    if not replacements:
        return
    with torch.no_grad():
        for module in root.modules():
            for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                if id(param) in replacements:
                    setattr(module, name, replacements[id(param)])
