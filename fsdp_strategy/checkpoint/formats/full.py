"""``FullFormat``: one ordinary Lightning file, as DDP writes and ``load_from_checkpoint`` reads, gathered on rank 0
(or handed to the Trainer's ``CheckpointIO`` plugin, as under DDP)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from torch import nn
from torch.optim import Optimizer

from fsdp_strategy.checkpoint import saving, state_dicts
from fsdp_strategy.checkpoint.background import BackgroundSave, live_storages
from fsdp_strategy.checkpoint.formats.base import SavedFormat
from fsdp_strategy.checkpoint.layout import gather_dtensors
from fsdp_strategy.checkpoint.location import Location, location_of
from fsdp_strategy.modes import CheckpointFormat
from fsdp_strategy.sharding.unshard import plain_optimizers

__all__ = ["FullFormat"]


class FullFormat(SavedFormat):
    name: ClassVar[CheckpointFormat] = CheckpointFormat.FULL
    single_file: ClassVar[bool] = True

    @classmethod
    def holds(cls, where: Location) -> bool:
        return True  # what no other format holds is read as one file; a missing one is named when read

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return state_dicts.model_state(model, full=True)

    def optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        return state_dicts.optimizer_state(model, optimizer, full=True, keep=self.strategy.is_global_zero)

    def save(
        self,
        checkpoint: dict[str, Any],
        where: Location,
        token: str,
        *,
        filepath: Any,
        storage_options: Any,
        background: BackgroundSave | None,
        group: Callable[[], Any],
    ) -> None:
        strategy = self.strategy
        # Sharded state a callback added (WeightAveraging's average), whole in the file as under DDP.
        checkpoint = gather_dtensors(checkpoint, keep=strategy.is_global_zero)
        if storage_options is not None or not saving.is_default_checkpoint_io(strategy.checkpoint_io):
            # The plugin writes the file as under DDP (Lightning's TorchCheckpointIO refuses `storage_options`).
            saving.save_through(
                strategy.checkpoint_io, checkpoint, filepath, storage_options, path=where, rank=strategy.global_rank
            )
            return
        live = lambda: _live_storages(strategy)  # noqa: E731
        saving.save_full(checkpoint, where, token, rank=strategy.global_rank, background=background, live=live)

    def load(self, where: Location, given: Any, *, weights_only: bool | None) -> dict[str, Any]:
        """The whole file on every rank."""
        plugin = self.strategy.checkpoint_io
        if saving.is_default_checkpoint_io(plugin):
            return state_dicts.read_full_checkpoint(where.value, weights_only=weights_only)
        # The plugin gets the path as the user gave it, unless this rank was given another one than rank 0.
        source = given if location_of(given) == where else where.value
        return state_dicts.require_state_dict(plugin.load_checkpoint(source, weights_only=weights_only), where.value)

    def load_optimizer_states(
        self, model: nn.Module, optimizers: Sequence[Optimizer], checkpoint: dict[str, Any]
    ) -> None:
        state_dicts.load_full_optimizers(optimizers, checkpoint.get("optimizer_states", []))


def _live_storages(strategy: Any) -> set[int]:
    return live_storages(strategy.model, plain_optimizers(strategy.optimizers))
