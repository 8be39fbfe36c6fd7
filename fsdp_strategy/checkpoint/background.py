"""Checkpoint saves in the background: one at a time per rank, with a copy of the tensors that
training changes in place, and older checkpoints removed only once their replacement is in place.

This rank's part only; :func:`fsdp_strategy.checkpoint.saving.settle` makes every rank agree on the outcome.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fsdp_strategy.checkpoint import writing

__all__ = ["SAVE_ERRORS", "BackgroundSave", "Outcome", "live_storages", "snapshot"]

SAVE_ERRORS = (Exception, CheckpointException)  # DCP's CheckpointException is a BaseException


def live_storages(module: nn.Module, optimizers: Iterable[Optimizer]) -> set[int]:
    """The storages that training changes in place: parameters, buffers and optimizer state (local shards)."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [
        v for opt in optimizers for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    return {_storage(t) for t in tensors}


def snapshot(checkpoint: dict[str, Any], live: set[int]) -> dict[str, Any]:
    """A copy of ``checkpoint`` that training cannot change while a background thread writes it.

    Model and optimizer tensors are cloned where they share memory with ``live`` storages (a "full"
    tensor of a single rank, a buffer, an optimizer's step count); the gathered ones are new already.
    The rest of the trainer state is small and cloned whole. Containers are copied.
    """
    large = ("state_dict", "optimizer_states")

    def copy(key: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t.detach().clone() if key not in large or _storage(t) in live else t

    return {key: apply_to_collection(value, torch.Tensor, copy(key)) for key, value in checkpoint.items()}


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


@dataclass
class Outcome:
    """A finished background save: the checkpoint, its staging entry, and this rank's error if it failed."""

    checkpoint: Path
    staging: Path | None
    error: BaseException | None


class BackgroundSave:
    """At most one checkpoint being written in the background on this rank, and the older
    checkpoints that wait for it: they are removed once it is in place, and kept if it fails.

    ``submit`` a save, ``defer_removal`` of what it replaces, ``wait`` for its outcome (this rank's
    only: the caller settles it across ranks), ``close`` at the end.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._job: _Job | None = None

    @property
    def pending(self) -> bool:
        return self._job is not None

    def submit(
        self,
        work: Callable[[], Any] | Future | None,
        *,
        checkpoint: Path,
        staging: Path | None,
        then: Callable[[], Any] | None = None,
    ) -> None:
        """``work`` runs on this object's thread (a callable), is running already (a future, e.g. DCP's
        ``async_save``), or is nothing on this rank (``None``). ``then`` runs after it succeeds (rank
        0 publishes the checkpoint), on the thread that completed it."""
        if self._job is not None:
            raise RuntimeError("A background save is still pending; wait() for it before submitting the next one.")
        if work is None:
            future: Future = Future()
            future.set_result(None)
        elif isinstance(work, Future):
            future = work
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2-checkpoint")
            future = self._executor.submit(work)
        self._job = _Job(future, then, Outcome(checkpoint, staging, None))

    def defer_removal(self, path: Any, remove: Callable[[Any], Any]) -> None:
        """Removes ``path`` with ``remove`` once the pending save is in place (now if none is pending or it
        is in place already); keeps it if that save failed."""
        if self._job is None or self._job.defer(path, remove):
            remove(path)

    def wait(self) -> Outcome | None:
        """Blocks until the pending save is finished; its outcome, or ``None`` if nothing was pending."""
        job, self._job = self._job, None
        return None if job is None else job.result()

    def close(self) -> None:
        """Waits for a pending save (removing its staging entry if it failed) and stops the thread."""
        outcome = self.wait()
        if outcome is not None and outcome.error is not None and outcome.staging is not None:
            with contextlib.suppress(OSError):  # best effort: the stage ended with another error
                writing.remove_path(outcome.staging)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class _Job:
    def __init__(self, future: Future, then: Callable[[], Any] | None, outcome: Outcome) -> None:
        self._then, self._outcome = then, outcome
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._removals: list[tuple[Any, Callable[[Any], Any]]] = []
        future.add_done_callback(self._finish)

    def _finish(self, future: Future) -> None:
        error = future.exception()
        if error is None and self._then is not None:
            try:
                self._then()
            except SAVE_ERRORS as then_error:
                error = then_error
        with self._lock:
            self._outcome.error = error
            removals, self._removals = ([] if error is not None else self._removals), []
            self._finished.set()
        for path, remove in removals:
            try:
                remove(path)
            except Exception as removal_error:  # the new checkpoint is in place; say what is left behind
                warnings.warn(f"Could not remove the replaced checkpoint '{path}': {removal_error}.", stacklevel=2)

    def defer(self, path: Any, remove: Callable[[Any], Any]) -> bool:
        """Queues the removal; ``True`` if the save is finished already and succeeded, so the caller removes now."""
        with self._lock:
            if not self._finished.is_set():
                self._removals.append((path, remove))
                return False
            return self._outcome.error is None

    def result(self) -> Outcome:
        self._finished.wait()
        return self._outcome
