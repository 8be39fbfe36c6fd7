"""``SavedFormat``: what one kind of checkpoint does, so that the manager only dispatches to it.

A format is picked once per stage for saving (by ``state_dict_type``, see :func:`~fsdp_strategy.checkpoint.formats.
format_named`) and, for loading, by what is saved at the path (:func:`~fsdp_strategy.checkpoint.formats.
saved_format`). A new format is one subclass in a file of its own, registered in
:data:`~fsdp_strategy.checkpoint.formats.FORMATS`: it implements :meth:`holds`, :meth:`model_state`,
:meth:`optimizer_state`, :meth:`save`, :meth:`load` and :meth:`load_optimizer_states`, and may override
:meth:`check_save`, :meth:`loads_model_after_sharding` and :meth:`load_model_after_sharding`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn
from torch.optim import Optimizer

from fsdp_strategy.checkpoint.background import BackgroundSave
from fsdp_strategy.checkpoint.location import Location
from fsdp_strategy.modes import CheckpointFormat
from fsdp_strategy.sharding.deferred_init import has_meta_tensors

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

__all__ = ["SavedFormat"]


class SavedFormat(ABC):
    """One kind of checkpoint, for the strategy ``strategy`` (its ranks, collectives, module and ``CheckpointIO``).

    An instance that loaded a checkpoint keeps what it needs of it until the optimizers and a module without
    values yet take their state (after sharding).
    """

    name: ClassVar[CheckpointFormat]
    """The decided ``state_dict_type`` that picks this format for saving."""

    single_file: ClassVar[bool]
    """One file per checkpoint, which a ``CheckpointIO`` plugin can write as it does under DDP."""

    holds_frozen: ClassVar[bool] = True
    """Whether the checkpoint holds the frozen parameters too; ``False``: a resume takes them from the module as
    built, or from ``init_weights``, which then are loaded before the checkpoint."""

    def __init__(self, strategy: ParallelStrategy, *, init_weights: Path | str | None) -> None:
        self.strategy = strategy
        self.init_weights = init_weights  # the strategy's option: where a resume takes the frozen parameters from

    @classmethod
    @abstractmethod
    def holds(cls, where: Location) -> bool:
        """Whether the checkpoint at ``where`` is written in this format."""

    @abstractmethod
    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The sharded ``model``'s state as this format saves it (``lightning_module_state_dict``)."""

    @abstractmethod
    def optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        """An optimizer's state as this format saves it; the optimizer is only read."""

    def check_save(self, storage_options: Any) -> None:
        """Refuses, before a save starts, arguments this format cannot honour."""
        return  # a format takes what Lightning passes unless it says otherwise

    @abstractmethod
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
        """Writes ``checkpoint`` (Lightning's dict) to ``where`` on every rank, staged under ``token``'s name and
        put in place once complete; with ``background``, on its thread (``group()``: the process group it talks
        over). ``filepath`` and ``storage_options`` are what Lightning passed, for a ``CheckpointIO`` plugin."""

    @abstractmethod
    def load(self, where: Location, given: Any, *, weights_only: bool | None) -> dict[str, Any]:
        """The checkpoint at ``where`` (rank 0's; ``given``: this rank's path as the user gave it) as Lightning's
        dict, read before the module is sharded, as DDP reads it."""

    @abstractmethod
    def load_optimizer_states(
        self, model: nn.Module, optimizers: Sequence[Optimizer], checkpoint: dict[str, Any]
    ) -> None:
        """Loads the saved optimizer states (``checkpoint``: the dict :meth:`load` returned, as
        ``on_load_checkpoint`` left it) into the optimizers of the sharded ``model``, without stepping them."""

    def loads_model_after_sharding(self, module: nn.Module) -> bool:
        """Whether the module state is loaded into the shards (:meth:`load_model_after_sharding`) rather than by
        the module's ``load_state_dict`` before sharding, as DDP loads it: a module without values cannot take it."""
        return has_meta_tensors(module)

    def load_model_after_sharding(self, module: nn.Module, *, strict: bool) -> None:
        """Loads the module state that a module without values could not take before sharding, where
        :meth:`load` left it in the files."""
        return  # a format read whole by load() leaves nothing in the files
