"""Bytes of tensor memory alive, and their peak, counted storage by storage, independent of the allocator.

:class:`LiveTensors` is a dispatch mode: every op's output storages are counted once, from the op that
creates them until they are freed (a weak reference to each storage says when), and a storage that
changes size (FSDP2 frees and re-allocates its gathered parameters by resizing their storages) is counted
at its new size. Views share their base's storage and count once. What it counts is exactly what the
estimator predicts (:mod:`fsdp_strategy.estimator.peak` runs the same mode over fake tensors): the bytes
of live tensors, without the allocator's caches, fragmentation or heap bookkeeping, which RSS includes.

Tensors created before the mode is entered count once :meth:`LiveTensors.track` is given them (a
module's parameters and buffers, an optimizer's state); :func:`existing_tensors` finds every one that
Python holds, FSDP2's freed (zero-size) all-gather outputs included, which grow again during a step. Storages each get a category (``"other"``
unless told otherwise) so that a caller can tell, say, gradients from activations at any moment.

Not seen: tensors created in other threads (a DataLoader's workers, a background checkpoint writer),
memory a kernel allocates for itself and frees before it returns, and ops run with dispatch disabled.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from fsdp_strategy._compat import TorchDispatchMode, is_fake, tree_flatten

__all__ = ["LiveTensors", "existing_tensors"]

OTHER = "other"


class _Storage:
    __slots__ = ("category", "nbytes", "ref")

    def __init__(self, nbytes: int, category: str) -> None:
        self.nbytes = nbytes
        self.category = category
        self.ref: weakref.ref | None = None


class LiveTensors(TorchDispatchMode):
    """Counts the bytes of live tensor storages while it is entered (``with LiveTensors() as live:``).

    ``current`` and ``peak`` are totals in bytes; ``by_category`` the current bytes per category.
    ``fake=True`` counts fake tensors (their storages have sizes but no memory), for predicting; by
    default fake tensors are left out, so that shape propagation inside DTensor does not count.
    ``on_op(live, func)`` is called after each op (the caller's timeline). With ``device``, only tensors of that
    device type count (``"cuda"``: what CUDA's ``memory_allocated`` sees, without the host's tensors).
    """

    def __init__(
        self,
        *,
        fake: bool = False,
        on_op: Callable[[LiveTensors, Any], None] | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__()
        self.fake = fake
        self.device = device
        self.on_op = on_op
        self.current = 0
        self.peak = 0
        self.by_category: dict[str, int] = {}
        self._storages: dict[int, _Storage] = {}  # by id of the Python storage object, kept alive by torch
        self._lock = threading.Lock()

    # --- counting ---

    def track(self, tensors: Iterable[Tensor | None], category: str = OTHER) -> None:
        """Counts tensors that exist already (created before the mode was entered)."""
        for tensor in tensors:
            if isinstance(tensor, Tensor):
                self._add(tensor, category)

    def categorize(self, tensor: Tensor, category: str) -> int:
        """Moves ``tensor``'s storage into ``category`` (counting it first if it is new); returns its bytes."""
        storage = self._storage_of(tensor)
        if storage is None:
            return 0
        entry = self._add(tensor, category)
        with self._lock:
            if entry.category != category:
                self._shift(entry.category, -entry.nbytes)
                entry.category = category
                self._shift(category, entry.nbytes)
        return entry.nbytes

    def category_of(self, tensor: Tensor) -> str | None:
        storage = self._storage_of(tensor)
        entry = None if storage is None else self._storages.get(id(storage))
        return None if entry is None else entry.category

    def reset_peak(self) -> None:
        """Starts the peak afresh from the bytes alive now."""
        self.peak = self.current

    def _storage_of(self, tensor: Tensor) -> torch.UntypedStorage | None:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if type(tensor) not in (Tensor, torch.nn.Parameter) and not (self.fake and is_fake(tensor)):
            return None  # a wrapper without storage of its own; its inner tensors are seen as they are made
        if is_fake(tensor) and not self.fake:
            return None
        if self.device is not None and tensor.device.type != self.device:
            return None
        try:
            return tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            return None

    def _add(self, tensor: Tensor, category: str) -> _Storage:
        storage = self._storage_of(tensor)
        if storage is None:
            return _Storage(0, category)
        key = id(storage)
        with self._lock:
            entry = self._storages.get(key)
            if entry is not None:
                self._resize(entry, storage.nbytes())  # in-place ops may have grown it (resize_, set_)
                return entry
            entry = _Storage(storage.nbytes(), category)
            self._storages[key] = entry
            self._shift(category, entry.nbytes)
        entry.ref = weakref.ref(storage, lambda _, key=key: self._freed(key))
        return entry

    def _freed(self, key: int) -> None:
        with self._lock:
            entry = self._storages.pop(key, None)
            if entry is not None:
                self._shift(entry.category, -entry.nbytes)

    def _resize(self, entry: _Storage, nbytes: int) -> None:
        if nbytes != entry.nbytes:
            self._shift(entry.category, nbytes - entry.nbytes)
            entry.nbytes = nbytes

    def _resized(self, storage: torch.UntypedStorage) -> None:
        with self._lock:
            entry = self._storages.get(id(storage))
            if entry is not None and entry.ref is not None and entry.ref() is storage:
                self._resize(entry, storage.nbytes())

    def _shift(self, category: str, delta: int) -> None:
        self.current += delta
        self.by_category[category] = self.by_category.get(category, 0) + delta
        if self.current > self.peak:
            self.peak = self.current

    # --- the mode ---

    def __enter__(self) -> LiveTensors:
        _watch_resizes(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _unwatch_resizes(self)
        # Dropping the entries drops their weak references, and with them the callbacks that would keep this
        # tracker attached to every storage that outlives the count (the model's, the optimizer's).
        with self._lock:
            self._storages.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # DTensor (and any other wrapper) first turns its op into ops on plain tensors, which come back here.
        # Fake tensors are run and, unless this mode counts fakes, not counted: DTensor propagates shapes
        # through fake tensors of its own.
        if any(not (t is Tensor or t is torch.nn.Parameter or is_fake(t)) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, Tensor):
                self._add(value, OTHER)
        if self.on_op is not None:
            self.on_op(self, func)
        return out


def existing_tensors() -> list[Tensor]:
    """Every real (not fake, not meta) tensor the garbage collector knows of: a step's starting point.

    Tensors are tracked by Python's collector, so this finds parameters, gradients, optimizer state,
    buffers, batches and the storages FSDP2 keeps at size zero between its all-gathers, without naming
    any of their owners. It walks every Python object once (a fraction of a second in a training process).
    """
    found = []
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some module-level objects warn on.
        if issubclass(type(obj), Tensor) and not is_fake(obj):
            try:
                if obj.device.type != "meta":
                    found.append(obj)
            except RuntimeError:  # a tensor whose device cannot be read (an undefined one)
                continue
    return found


# UntypedStorage.resize_ is a storage method that bypasses dispatch (FSDP2's alloc_storage/free_storage use
# it), so it is wrapped while a tracker is entered, as torch's own MemTracker does. One wrapper serves all.
_WATCHERS: list[LiveTensors] = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


@wraps(_ORIGINAL_RESIZE)
def _resize_and_tell(storage: torch.UntypedStorage, size: int) -> Any:
    result = _ORIGINAL_RESIZE(storage, size)
    for watcher in list(_WATCHERS):
        watcher._resized(storage)
    return result


def _watch_resizes(tracker: LiveTensors) -> None:
    _WATCHERS.append(tracker)
    torch.UntypedStorage.resize_ = _resize_and_tell  # type: ignore[method-assign]


def _unwatch_resizes(tracker: LiveTensors) -> None:
    if tracker in _WATCHERS:
        _WATCHERS.remove(tracker)
    if not _WATCHERS:
        torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]
