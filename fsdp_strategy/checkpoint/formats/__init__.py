"""Checkpoint formats as classes (:class:`~fsdp_strategy.checkpoint.formats.base.SavedFormat`): the manager picks
one for saving by name, once per stage, and one for loading by what is saved, and only dispatches to them.

* ``base``: ``SavedFormat``, the methods every format implements;
* ``sharded``: ``ShardedFormat``, a Distributed Checkpoint directory;
* ``full``: ``FullFormat``, one Lightning file;
* ``adapter``: ``AdapterFormat``, a sharded checkpoint without the frozen parameters, and a record of their base.
"""

from __future__ import annotations

from typing import Any

from fsdp_strategy.checkpoint.formats.adapter import AdapterFormat
from fsdp_strategy.checkpoint.formats.base import SavedFormat
from fsdp_strategy.checkpoint.formats.full import FullFormat
from fsdp_strategy.checkpoint.formats.sharded import ShardedFormat
from fsdp_strategy.checkpoint.location import location_of
from fsdp_strategy.modes import CheckpointFormat

__all__ = ["FORMATS", "AdapterFormat", "FullFormat", "SavedFormat", "ShardedFormat", "format_named", "saved_format"]

FORMATS: tuple[type[SavedFormat], ...] = (AdapterFormat, ShardedFormat, FullFormat)
"""Every format, in the order :func:`saved_format` asks them: an adapter checkpoint is a sharded one with a record,
so it is asked first; ``FullFormat``, which takes any file, is last."""


def format_named(name: CheckpointFormat) -> type[SavedFormat]:
    """The format that saves checkpoints of the decided ``state_dict_type`` ``name``."""
    return next(kind for kind in FORMATS if kind.name == name)


def saved_format(path: Any) -> type[SavedFormat]:
    """The format of the checkpoint saved at ``path``."""
    where = location_of(path)
    return next(kind for kind in FORMATS if kind.holds(where))
