"""``ShardedFormat``: a Distributed Checkpoint directory (on a URL, a shard prefix named by a manifest), each rank
writing and reading its own shards."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from torch import nn
from torch.optim import Optimizer

from fsdp_strategy.checkpoint import saving, state_dicts, storage, verify
from fsdp_strategy.checkpoint.background import BackgroundSave
from fsdp_strategy.checkpoint.errors import CheckpointError
from fsdp_strategy.checkpoint.formats.base import SavedFormat
from fsdp_strategy.checkpoint.location import Location
from fsdp_strategy.launch.rendezvous import on_rank_zero
from fsdp_strategy.modes import CheckpointFormat

__all__ = ["ShardedFormat"]


class ShardedFormat(SavedFormat):
    name: ClassVar[CheckpointFormat] = CheckpointFormat.SHARDED
    single_file: ClassVar[bool] = False

    files: storage.CheckpointFiles | None = None  # of the checkpoint loaded; its optimizer states are read after setup

    @classmethod
    def holds(cls, where: Location) -> bool:
        return verify.is_sharded_checkpoint(where)

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return state_dicts.model_state(model, full=False)

    def optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        return state_dicts.optimizer_state(model, optimizer, full=False, keep=self.strategy.is_global_zero)

    def check_save(self, storage_options: Any) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self.strategy).__name__}.save_checkpoint does not take `storage_options` for sharded"
                f" checkpoints; got {storage_options!r}. They are meant for a CheckpointIO plugin, which writes single"
                ' files: pass `state_dict_type="full"`.'
            )

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
        saving.save_sharded(
            checkpoint, where, token, rank=self.strategy.global_rank, background=background, group=group
        )

    def load(self, where: Location, given: Any, *, weights_only: bool | None) -> dict[str, Any]:
        """The trainer state, and the module state in full (in place, into the module's own tensors); a module
        built without its values gets them after sharding instead (:meth:`load_model_after_sharding`)."""
        strategy, module = self.strategy, self.strategy.lightning_module
        assert module is not None
        # None: the user did not choose; torch.load's default since 2.6 is True.
        trusted = weights_only is False

        def check() -> str:
            # On a URL, rank 0 follows the manifest once: every rank reads the files it named then.
            files = storage.checkpoint_files(where)
            verify.verify_sharded_checkpoint(files, weights_only=not trusted)
            return str(files.source)

        # Rank 0 checks every file before any rank unpickles or reads one; a refusal is raised on every rank.
        source = strategy.broadcast(on_rank_zero(check, CheckpointError, strategy.is_global_zero, strategy.broadcast))
        self.files = storage.files_at(source, name=where.value)
        whole = not self.loads_model_after_sharding(module)
        return state_dicts.read_sharded(
            self.files, module, strict=module.strict_loading, weights_only=not trusted, whole=whole
        )

    def load_optimizer_states(
        self, model: nn.Module, optimizers: Sequence[Optimizer], checkpoint: dict[str, Any]
    ) -> None:
        assert self.files is not None
        state_dicts.load_sharded_optimizers(self.files, model, optimizers, checkpoint["optimizer_states"])

    def load_model_after_sharding(self, module: nn.Module, *, strict: bool) -> None:
        if self.files is not None:
            state_dicts.load_sharded_model(self.files, module, strict=strict)
