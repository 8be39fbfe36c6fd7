"""The modes an option can name, as str-valued enums: checked once in :mod:`fsdp_strategy.options`, then passed
as these members to every module that acts on them, so no module compares mode strings.

They sit below the folders (like ``sizes.py``) so that ``step/`` and ``checkpoint/`` can take them without
importing the options module above them.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["CheckpointFormat", "HookView", "HostMemory", "NonFiniteGrads", "StateDictType"]


class _Mode(str, Enum):
    # Printed and formatted as the plain string the user passed, in messages and logs.
    __str__ = str.__str__
    __format__ = str.__format__


class StateDictType(_Mode):
    AUTO = "auto"  # "full" while rank 0 can hold the whole state, decided when the model is set up
    SHARDED = "sharded"
    FULL = "full"
    ADAPTER = "adapter"  # a sharded checkpoint without the frozen parameters

    @property
    def checkpoint_format(self) -> CheckpointFormat | None:
        """The format this type always saves; ``None`` for ``AUTO``, which decides it per model."""
        return _FORMAT_OF.get(self)


class CheckpointFormat(_Mode):
    """What the checkpoints are: ``state_dict_type`` with ``"auto"`` decided."""

    SHARDED = "sharded"  # a Distributed Checkpoint directory
    FULL = "full"  # one Lightning checkpoint file
    ADAPTER = "adapter"  # a Distributed Checkpoint directory of what training changes, and a record of the base


_FORMAT_OF = {
    StateDictType.SHARDED: CheckpointFormat.SHARDED,
    StateDictType.FULL: CheckpointFormat.FULL,
    StateDictType.ADAPTER: CheckpointFormat.ADAPTER,
}


class NonFiniteGrads(_Mode):
    IGNORE = "ignore"
    SKIP = "skip"
    RAISE = "raise"


class HostMemory(_Mode):
    KEEP = "keep"  # leave the allocator alone
    # Hand free heap pages back after sharding (the eager full model freed) and at each phase end of a training
    # step: after forward, after backward, after the optimizer step.
    RELEASE = "release"


class HookView(_Mode):
    WHOLE = "whole"
    SHARDED = "sharded"
