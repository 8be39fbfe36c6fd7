"""Lightning's ``ModelPruning`` callback, refused before training: pruning rewrites parameters a sharded unit holds.

``torch.nn.utils.prune`` (what ``ModelPruning`` calls) removes each pruned parameter from its module, registers
the original as ``<name>_orig`` with a ``<name>_mask`` buffer, and recomputes ``<name>`` in a forward pre-hook. FSDP2
keeps each parameter's shards and gathers them under the parameter's name; after pruning it would gather a
parameter that is no longer there (and ``torch.topk`` over a shard ranks one rank's weights only). Without the
refusal the run fails mid-epoch, and the error is then hidden by FSDP's own at teardown.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

__all__ = ["refuse_model_pruning"]


def refuse_model_pruning(callbacks: Iterable[Any]) -> None:
    """Raises ``MisconfigurationException`` for Lightning's ``ModelPruning`` callback (and subclasses)."""
    from lightning.pytorch.callbacks import ModelPruning

    for callback in callbacks:
        if isinstance(callback, ModelPruning):
            raise MisconfigurationException(
                f"{type(callback).__name__} cannot prune a sharded module: torch.nn.utils.prune replaces each pruned"
                " parameter by '<name>_orig' and a mask, while FSDP2 holds and gathers the parameter's shards under"
                " its own name. Prune the plain module instead: after `trainer.fit` it is whole again (prune it,"
                " then fine-tune with strategy='fsdp2' after `torch.nn.utils.prune.remove`), or train with"
                " strategy='ddp' while pruning."
            )
