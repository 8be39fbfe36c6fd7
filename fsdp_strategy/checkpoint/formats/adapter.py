"""``AdapterFormat``: a sharded checkpoint of what training changes, without the frozen parameters (a LoRA run's
base model), and ``adapter.json``, the record of the base those come from
(:mod:`~fsdp_strategy.checkpoint.adapter_base`).

It holds every parameter that needs a gradient or has optimizer state, the buffers, the optimizers' states and the
trainer state, in the layout of :class:`~fsdp_strategy.checkpoint.formats.sharded.ShardedFormat` (so ``consolidate``,
``verify`` and the exports read it too). A resume takes the frozen parameters from the module as built, or from
``init_weights`` (loaded first, once its content is checked against the record), and the rest from the checkpoint.
A module without frozen parameters saves them all: the checkpoint is then a sharded one with a record.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from fsdp_strategy.checkpoint import saving, state_dicts, storage, verify, writing
from fsdp_strategy.checkpoint.adapter_base import (
    RECORD_NAME,
    BaseRecord,
    check_base,
    check_values,
    frozen_parameters,
    value_moments,
    weights_hash,
)
from fsdp_strategy.checkpoint.background import BackgroundSave
from fsdp_strategy.checkpoint.errors import CheckpointError
from fsdp_strategy.checkpoint.formats.sharded import ShardedFormat
from fsdp_strategy.checkpoint.location import Location
from fsdp_strategy.launch.rendezvous import on_rank_zero
from fsdp_strategy.modes import CheckpointFormat
from fsdp_strategy.sharding.unshard import plain_optimizers

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

__all__ = ["AdapterFormat"]


class AdapterFormat(ShardedFormat):
    name: ClassVar[CheckpointFormat] = CheckpointFormat.ADAPTER
    single_file: ClassVar[bool] = False
    holds_frozen: ClassVar[bool] = False

    record: BaseRecord | None = None  # of the checkpoint loaded, or of the state taken for the next save
    _told: bool = False

    def __init__(self, strategy: ParallelStrategy, *, init_weights: Path | str | None) -> None:
        super().__init__(strategy, init_weights=init_weights)
        self._moments: dict[str, tuple[float, float]] = {}  # of the frozen parameters, which do not change

    @classmethod
    def holds(cls, where: Location) -> bool:
        if not verify.is_sharded_checkpoint(where):
            return False
        try:
            return storage.checkpoint_files(where).is_file(RECORD_NAME)
        except (OSError, ValueError):  # a manifest that cannot be read: ShardedFormat names what is wrong
            return False

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        frozen = frozen_parameters(model, plain_optimizers(self.strategy.optimizers))
        moments = {}
        if self.init_weights is None:  # the values come from the module as built: a fingerprint of them, once
            dtypes = {name: dtype for name, (_, dtype) in frozen.items()}
            self._moments.update(value_moments(model, [n for n in frozen if n not in self._moments], dtypes))
            moments = {name: self._moments[name] for name in frozen}
        self.record = BaseRecord(frozen, None if self.init_weights is None else str(self.init_weights), None, moments)
        if not self._told:  # at the first save of the strategy: what it leaves out, and what it holds
            self._told = True
            rank_zero_info(_summary(model, frozen, strategy=type(self.strategy).__name__))
        state = state_dicts.model_state(model, full=False)
        return {name: value for name, value in state.items() if name not in frozen}

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
        if self.record is None:  # a checkpoint dict made elsewhere than by Lightning's dump_checkpoint
            assert strategy.model is not None
            self.model_state(strategy.model)
        record = self.record
        assert record is not None
        staging = writing.staging_path(where, token)

        def write_record() -> None:
            hashed = record if record.init_weights is None else _hashed(record)
            staging.join(RECORD_NAME).write_bytes(hashed.to_json())

        # Into the staging directory before the shards: the rename that publishes them publishes the record too.
        error = saving.attempt(write_record) if strategy.is_global_zero else None
        saving.settle(error, checkpoint=where.value, staging=staging, rank=strategy.global_rank)
        super().save(
            checkpoint,
            where,
            token,
            filepath=filepath,
            storage_options=storage_options,
            background=background,
            group=group,
        )

    def loads_model_after_sharding(self, module: nn.Module) -> bool:
        # `init_weights` are loaded into the shards, and the saved state over them.
        return self.init_weights is not None or super().loads_model_after_sharding(module)

    def load(self, where: Location, given: Any, *, weights_only: bool | None) -> dict[str, Any]:
        """As :meth:`ShardedFormat.load`, once rank 0 has checked that the module and ``init_weights`` are the base
        the checkpoint was trained on. The ``state_dict`` holds the frozen parameters too, as the module has them,
        so that the module's ``load_state_dict`` sees a whole state, as from any checkpoint."""
        strategy, module = self.strategy, self.strategy.lightning_module
        assert module is not None
        trusted = weights_only is False

        def check() -> tuple[str, BaseRecord]:
            files = storage.checkpoint_files(where)
            verify.verify_sharded_checkpoint(files, weights_only=not trusted)
            record = BaseRecord.read(files)
            check_base(record, self.init_weights, module, checkpoint=files.name)
            return str(files.source), record

        # Rank 0 checks the files and the base before any rank reads one; a refusal is raised on every rank.
        checked = on_rank_zero(check, CheckpointError, strategy.is_global_zero, strategy.broadcast)
        source, self.record = strategy.broadcast(checked)
        self.files = storage.files_at(source, name=where.value)
        frozen = self.record.frozen
        whole = not self.loads_model_after_sharding(module)
        checkpoint = state_dicts.read_sharded(
            self.files, module, strict=module.strict_loading, weights_only=not trusted, whole=whole, leave_out=frozen
        )
        if whole:
            loaded = checkpoint["state_dict"]  # the module's own tensors, loaded in place
            own = nn.Module.state_dict(module)
            checkpoint["state_dict"] = {k: v for k, v in own.items() if k in loaded or k in frozen}
        return checkpoint

    def load_model_after_sharding(self, module: nn.Module, *, strict: bool) -> None:
        if self.files is None or self.record is None:
            return
        if self.init_weights is None:  # a module built without values: its frozen parameters' values are new now
            check_values(self.record, module, checkpoint=self.files.name)
        state_dicts.load_sharded_model(self.files, module, strict=strict, leave_out=self.record.frozen)


def _hashed(record: BaseRecord) -> BaseRecord:
    assert record.init_weights is not None
    return BaseRecord(record.frozen, record.init_weights, weights_hash(record.init_weights), record.moments)


def _summary(model: nn.Module, frozen: dict[str, Any], *, strategy: str) -> str:
    if not frozen:
        return (
            f"{strategy}: the module has no frozen parameters, so its adapter checkpoints"
            ' (state_dict_type="adapter") hold every parameter, as sharded ones do.'
        )
    left_out = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in frozen}
    total = sum(p.numel() for p in model.parameters())  # each tied parameter once
    kept = sum(p.numel() for p in model.parameters() if id(p) not in left_out)
    return (
        f"{strategy}: adapter checkpoints hold {kept:,} of the {total:,} parameters ({kept / total:.2%}) and their"
        " optimizer states; the frozen ones left out come from the module as built or `init_weights` at a resume."
    )
