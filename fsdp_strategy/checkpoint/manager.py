"""``CheckpointManager``: what the strategy does with checkpoints, behind Lightning's checkpoint hooks.

It decides the checkpoint format once per model (``state_dict_type``, ``"auto"`` resolved), saves (in the
background with ``async_save``, over a gloo group of its own), loads before the module is sharded as DDP does,
and keeps what a module without values yet can only take after sharding (:meth:`restore_after_sharding`). What
differs between formats is the format objects' (:mod:`~fsdp_strategy.checkpoint.formats`): this only dispatches.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer

from fsdp_strategy import host_memory
from fsdp_strategy.checkpoint import background, pretrained, saving, state_dicts
from fsdp_strategy.checkpoint.formats import FullFormat, SavedFormat, format_named, saved_format
from fsdp_strategy.checkpoint.location import location_of
from fsdp_strategy.checkpoint.peft_record import PEFT_KEY, peft_record
from fsdp_strategy.checkpoint.staging import remove_stale_staging, staging_token
from fsdp_strategy.launch.rendezvous import all_ranks_agree, on_rank_zero
from fsdp_strategy.modes import CheckpointFormat, StateDictType
from fsdp_strategy.sharding.parallelize import load_full_tensors_into_shards
from fsdp_strategy.sharding.unshard import sharded_optimizers
from fsdp_strategy.sizes import format_bytes

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

__all__ = ["CheckpointManager"]


@dataclass
class _Restore:
    """What a stage restores from the checkpoint ``path`` once the module is sharded."""

    path: Path | str
    format: SavedFormat  # the format it was loaded with, which keeps what is read after setup
    model_state: dict[str, Any] | None = None  # a single file's weights for a module that had no values before sharding
    strict: bool | None = None  # set when the module state is still to be loaded


class CheckpointManager:
    """The checkpoints of one strategy; ``strategy`` gives the ranks, the collectives, the module and the
    ``CheckpointIO`` plugin, which Lightning sets on the strategy after it is built. The other arguments are the
    strategy's options of those names, checked: ``timeout`` is that of the background saves' process group,
    ``init_weights`` the weights a resume from a checkpoint without the frozen parameters takes them from."""

    def __init__(
        self,
        strategy: ParallelStrategy,
        *,
        state_dict_type: StateDictType,
        async_save: bool,
        timeout: timedelta,
        init_weights: Path | str | None,
    ) -> None:
        self.strategy = strategy
        self.state_dict_type = state_dict_type
        self.async_save = async_save
        self.timeout = timeout
        self.init_weights = init_weights
        self.format: CheckpointFormat | None = None  # decided in setup(), or by the first save before any setup
        self.saves = background.BackgroundSave()
        self._saved_as: SavedFormat | None = None
        self.restore: _Restore | None = None
        self._group: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # A pickled Trainer leaves out this process's threads and process groups, as DDPStrategy holds none.
        return {**self.__dict__, "saves": background.BackgroundSave(), "restore": None, "_group": None}

    @property
    def name(self) -> str:
        return type(self.strategy).__name__

    # --- format -----------------------------------------------------------------------------------

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        if self.format is None:  # a save before any setup (trainer.strategy.connect(model))
            model = self.strategy.model or self.strategy.lightning_module
            if model is None:
                return self.state_dict_type.checkpoint_format or CheckpointFormat.FULL
            self.format = self._choose_format(model)
        return self.format

    @property
    def saved_as(self) -> SavedFormat:
        """The format that saves write, picked for the decided ``checkpoint_format``."""
        kind = format_named(self.checkpoint_format)
        if type(self._saved_as) is not kind:
            self._saved_as = kind(self.strategy, init_weights=self.init_weights)
        return self._saved_as

    def setup(self, model: nn.Module) -> None:
        """Decides the format for the stage's model (once per strategy) and checks the ``CheckpointIO`` plugin."""
        if self.format is None:
            self.format = self._choose_format(model)
        saving.check_checkpoint_io(
            self.strategy.checkpoint_io,
            sharded=not self.saved_as.single_file,
            state_dict_type=self.saved_as.name,
            async_save=self.async_save,
            strategy=self.name,
        )

    def _choose_format(self, model: nn.Module) -> CheckpointFormat:
        if self.state_dict_type.checkpoint_format is not None:
            return self.state_dict_type.checkpoint_format
        if not saving.is_default_checkpoint_io(self.strategy.checkpoint_io):
            return CheckpointFormat.FULL  # a CheckpointIO plugin writes single files, as it does under DDP
        # "auto": one file, as DDP writes and `load_from_checkpoint` reads, while rank 0 can hold the whole
        # state in host memory with room to spare; Distributed Checkpoint directories beyond that.
        params = {id(p): p for p in model.parameters()}.values()
        estimate = 3 * sum(p.numel() * p.element_size() for p in params)  # weights + two optimizer states
        available = host_memory.available() if self.strategy.is_global_zero else None
        fits = available is None or estimate <= available // 4
        chosen = self.strategy.broadcast(CheckpointFormat.FULL if fits else CheckpointFormat.SHARDED)
        full = chosen == CheckpointFormat.FULL
        rank_zero_info(
            f"{self.name}: checkpoints are {'single files' if full else 'sharded directories'}"
            f" (state_dict_type='auto': the full state, about {format_bytes(estimate)} with an optimizer like Adam,"
            f" {'fits' if full else 'does not fit'} in a quarter of rank 0's free host memory)."
            " Pass state_dict_type='full' or 'sharded' to choose."
        )
        return chosen

    # --- saving -----------------------------------------------------------------------------------

    def model_state(self) -> dict[str, Any]:
        assert self.strategy.model is not None
        return self.saved_as.model_state(self.strategy.model)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.strategy.model is not None
        return self.saved_as.optimizer_state(self.strategy.model, optimizer)

    def save(self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None) -> None:
        """Writes the checkpoint aside, then renames it into place once every rank has finished, so a
        crash or a failed write leaves the previous checkpoints intact; a failure on any rank raises
        :class:`~fsdp_strategy.checkpoint.saving.CheckpointSaveError` on every rank. With ``async_save`` the writing
        runs in the background and the next save (or load, or the end of the stage) waits for it.
        Full checkpoints go through the Trainer's ``CheckpointIO`` plugin when one is given, as under DDP."""
        strategy, saved_as = self.strategy, self.saved_as
        saved_as.check_save(storage_options)
        record = None if strategy.lightning_module is None else peft_record(strategy.lightning_module)
        if record is not None:  # the adapters' configs and names, for the PEFT export from any checkpoint of the run
            checkpoint = {**checkpoint, PEFT_KEY: record}
        self.wait()
        where = location_of(strategy.broadcast(str(filepath)))
        token = strategy.broadcast(staging_token())
        if strategy.is_global_zero:
            remove_stale_staging(where.parent)
        saved_as.save(
            checkpoint,
            where,
            token,
            filepath=filepath,
            storage_options=storage_options,
            background=self.saves if self.async_save else None,
            group=self._background_group,
        )

    def _background_group(self) -> Any:
        # Background saves talk over their own gloo group, so they never interleave with the
        # training collectives on the default group.
        if self._group is None:
            self._group = torch.distributed.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    def wait(self) -> None:
        """Blocks until a background save has finished; if it failed on any rank, raises its error on every rank."""
        outcome = self.saves.wait()
        if outcome is not None:
            saving.settle(
                outcome.error, checkpoint=outcome.checkpoint, staging=outcome.staging, rank=self.strategy.global_rank
            )

    def remove(self, filepath: str | os.PathLike) -> None:
        if self.strategy.is_global_zero:
            # Not before the save in the background that replaces it is in place.
            self.saves.defer_removal(filepath, saving.remover(self.strategy.checkpoint_io))

    def close(self) -> None:
        self.saves.close()

    # --- loading ----------------------------------------------------------------------------------

    def begin_stage(self) -> None:
        self.restore = None

    @property
    def restoring(self) -> bool:
        """A checkpoint is being loaded in this stage (it wins over ``init_weights``)."""
        return self.restore is not None

    def load(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Reads a checkpoint before the module is sharded, as DDP does, so that Lightning calls
        ``on_load_checkpoint`` and ``load_state_dict`` in DDP's order: a single file whole on every rank; a sharded
        checkpoint's trainer state, and its module state in full (in place, into the module's own tensors). A module
        built without its values (``meta_init``, ``init_module(empty_init=True)``) gets them after sharding instead:
        each rank reads its shards. Optimizer states are loaded into the sharded optimizers after ``setup``."""
        strategy = self.strategy
        self.wait()
        where = location_of(strategy.broadcast(str(checkpoint_path)))
        self.restore = _Restore(where.value, saved_format(where)(strategy, init_weights=self.init_weights))
        return self.restore.format.load(where, checkpoint_path, weights_only=weights_only)

    def load_model_state(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        # As DDP, after `on_load_checkpoint`: the module's own `load_state_dict`, before sharding. A module without
        # values yet gets them in setup(), once it is sharded and materialized.
        module = self.strategy.lightning_module
        assert module is not None
        if self.restore is not None and self.restore.format.loads_model_after_sharding(module):
            self.restore.model_state, self.restore.strict = checkpoint.get("state_dict"), strict
            return
        if "state_dict" not in checkpoint:
            raise KeyError(
                f"The checkpoint '{self.restore.path if self.restore else ''}' holds no 'state_dict' entry: an"
                " `on_load_checkpoint` hook removed it."
            )
        self._load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_states(self, checkpoint: dict[str, Any]) -> None:
        # As DDP's `optimizer.load_state_dict`: the optimizers are not stepped to create their state first.
        model = self.strategy.model
        assert model is not None
        loaded_as = self.restore.format if self.restore is not None else FullFormat(self.strategy, init_weights=None)
        loaded_as.load_optimizer_states(model, sharded_optimizers(self.strategy.optimizers), checkpoint)

    def _load_state_dict(self, state_dict: dict[str, Any], *, strict: bool) -> None:
        module = self.strategy.lightning_module
        assert module is not None
        # A module its `configure_model` split or sharded (ModelParallelStrategy's way) holds DTensors before the
        # stage registers its own hooks: each rank takes its slices of the whole tensors a single file holds.
        slicing = load_full_tensors_into_shards(module)
        try:
            module.load_state_dict(state_dict, strict=strict)
        except RuntimeError as error:  # torch's "Error(s) in loading state_dict": name the checkpoint and the keys
            path = self.restore.path if self.restore is not None else "<checkpoint>"
            state_dicts.check_full_state_dict(module, state_dict, strict=strict, path=path)
            raise error
        finally:
            for handle in slicing:
                handle.remove()

    def init_weights_loader(self) -> Callable[[nn.Module], None] | None:
        """What loads ``init_weights`` into the sharded module; ``None`` without them or when a checkpoint to
        resume from, which wins, is being loaded (unless it holds no frozen parameters: they come from them)."""
        if self.init_weights is None or (self.restore is not None and self.restore.format.holds_frozen):
            return None
        return self._load_init_weights

    def _load_init_weights(self, model: nn.Module) -> None:
        path, strategy = self.init_weights, self.strategy
        if pretrained.is_weights_directory(path):
            return self._load_pretrained(model, path)  # type: ignore[arg-type]
        weights = on_rank_zero(
            lambda: state_dicts.read_full_weights(path),  # type: ignore[arg-type]
            lambda message: ValueError(f"Could not read `init_weights` '{path}' on rank 0: {message}"),
            strategy.is_global_zero,
            strategy.broadcast,
        )
        assert strategy.lightning_module is not None
        state_dicts.load_full_weights(model, weights or {}, strict=strategy.lightning_module.strict_loading)

    def _load_pretrained(self, model: nn.Module, path: Path) -> None:
        # Every rank reads its own slices: no rank holds the full model, nothing is broadcast. The checks of names
        # and shapes give every rank the same error; a read that fails on one rank only fails them all together.
        strategy = self.strategy
        assert strategy.lightning_module is not None
        error: Exception | None = None
        try:
            pretrained.load_pretrained(model, path, strict=strategy.lightning_module.strict_loading)
        except Exception as exc:  # whatever it is, the other ranks must not go on into training without this one
            error = exc
        if not all_ranks_agree(error is None, strategy.root_device):
            if error is not None:
                raise error
            raise ValueError(f"Could not read `init_weights` '{path}' on another rank; its log names why.")

    def restore_after_sharding(self) -> None:
        """Loads the module state that a module without values could not take before it was sharded."""
        restore, module = self.restore, self.strategy.lightning_module
        if restore is None or module is None:
            return
        if restore.model_state is not None:
            self._load_state_dict(restore.model_state, strict=bool(restore.strict))  # each rank keeps its shards
        elif restore.strict is not None:
            restore.format.load_model_after_sharding(module, strict=restore.strict)
        restore.model_state, restore.strict = None, None
