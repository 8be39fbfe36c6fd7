"""Layer types as DDP shows them while the module is sharded.

``fully_shard`` moves each module it shards into a class of its own, ``FSDP<Name>`` (a subclass of ``FSDPModule``
and the module's class), and what users read takes the class's ``__name__``: Lightning's ``ModelSummary`` and
``summarize`` (its "Type" column), ``print(model)``. :class:`PlainClassNames` gives those classes their module
class's name for the stage and the ``FSDP`` name back after it. Only ``__name__`` changes: ``isinstance``, the
class's ``__qualname__`` (in ``type(module)``'s repr and pickling errors) and torch's own class cache stay as they
are. The classes are shared by every module of one class in the process, so a module that its user shards with
``fully_shard`` during the stage shows the plain name too.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["PlainClassNames", "module_class"]


def module_class(sharded_class: type) -> type | None:
    """The module's own class under ``fully_shard``'s ``FSDP<Name>`` class; ``None`` for any other class."""
    if not issubclass(sharded_class, FSDPModule):
        return None
    return next((base for base in sharded_class.__bases__ if base is not FSDPModule), None)


class PlainClassNames:
    """Renames the sharded classes of a module between :meth:`show` and :meth:`restore`."""

    def __init__(self) -> None:
        self._renamed: dict[type, str] = {}  # class -> the name it had

    def show(self, model: nn.Module) -> None:
        for module in model.modules():
            sharded_class = type(module)
            original = module_class(sharded_class)
            if original is None or sharded_class in self._renamed or sharded_class.__name__ == original.__name__:
                continue
            self._renamed[sharded_class] = sharded_class.__name__
            sharded_class.__name__ = original.__name__

    def restore(self) -> None:
        for sharded_class, name in self._renamed.items():
            sharded_class.__name__ = name
        self._renamed = {}
