"""``trainer.fit(ckpt_path="last")`` when ``ModelCheckpoint`` saves to a URL.

Lightning (checked up to 2.6.6) finds "last" by listing each ``ModelCheckpoint``'s directory with fsspec
and then opening what the listing returned as a path of the *local* disk: object stores list their keys
without the ``s3://`` in front, so no candidate exists, Lightning warns that there is no last checkpoint
and trains from scratch (Lightning issue #18261; DDP does the same). This module finds the newest
``last*.ckpt`` itself when a ``ModelCheckpoint`` writes to a URL, among the checkpoints that are
published (on a URL a name appears only when its checkpoint is complete, see :mod:`fsdp_strategy.checkpoint.storage`),
and :class:`ResumingLauncher` hands that URL to the Trainer call in place of ``"last"``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

from fsdp_strategy._compat import ScriptLauncher
from fsdp_strategy.checkpoint.location import location_of

__all__ = ["ResumingLauncher", "find_last", "resolve_ckpt_path"]


def find_last(callbacks: Iterable[Any]) -> str | None:
    """The newest last checkpoint of the ``ModelCheckpoint`` callbacks, if any of them saves to a URL.

    ``None`` when none saves to a URL (Lightning's own lookup is right then) or none is found. Local
    directories of the other callbacks are searched too, as Lightning would, and the newest wins.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpointers = [c for c in callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    if not any(location_of(c.dirpath).remote for c in checkpointers):
        return None
    found: dict[str, float] = {}
    for callback in checkpointers:
        pattern = re.compile(
            rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-(\d+))?{re.escape(callback.FILE_EXTENSION)}$"
        )
        found.update(_candidates(str(callback.dirpath), pattern))
    return max(found, key=found.__getitem__) if found else None


def _candidates(directory: str, pattern: re.Pattern[str]) -> dict[str, float]:
    where = location_of(directory)
    try:
        entries = where.entries()
    except OSError:
        return {}
    found = {}
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        # On a URL every checkpoint is one object (a sharded one's manifest); locally a sharded one is a directory.
        if pattern.match(name) and (entry.get("type") == "file" or not where.remote):
            candidate = where.join(name)
            found[str(candidate)] = candidate.modified()
    return found


def resolve_ckpt_path(
    function: Callable[..., Any], args: tuple, kwargs: dict, callbacks: Iterable[Any]
) -> tuple[tuple, dict]:
    """``args``/``kwargs`` of a Trainer call with ``ckpt_path="last"`` replaced by the URL :func:`find_last` found."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    if bound.arguments.get("ckpt_path") != "last":
        return args, kwargs
    found = find_last(callbacks)
    if found is None:
        return args, kwargs
    bound.arguments["ckpt_path"] = found
    return bound.args, bound.kwargs


class ResumingLauncher(ScriptLauncher):
    """Lightning's launcher of the other local processes (``"ddp"``'s), which also resolves ``ckpt_path="last"``
    on URLs (:func:`resolve_ckpt_path`) before the Trainer call runs. Under a launcher that starts the
    processes itself (torchrun, SLURM) it starts nothing and only resolves."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            args, kwargs = resolve_ckpt_path(function, args, kwargs, trainer.callbacks)
        if self.cluster_environment.creates_processes_externally:
            return function(*args, **kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)
