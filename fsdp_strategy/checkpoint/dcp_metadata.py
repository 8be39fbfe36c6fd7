"""DCP's index ``.metadata``, unpickled without running code stored in it.

``.metadata`` is a pickled ``torch.distributed.checkpoint.metadata.Metadata``. DCP's own ``dcp.load``
reads it with plain :func:`pickle.load`, which would run whatever the file asks for; here it is read by
an unpickler that only builds the classes DCP metadata is made of, and anything else is reported as a
:class:`~fsdp_strategy.checkpoint.errors.CheckpointError` naming the checkpoint directory and the file.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pathlib
import pickle
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from fsdp_strategy._compat import get_layout
from fsdp_strategy.checkpoint.errors import damaged, first_line
from fsdp_strategy.checkpoint.storage import checkpoint_files, read_checkpoint_file

__all__ = ["DCP_METADATA_FILENAME", "read_dcp_metadata"]

DCP_METADATA_FILENAME = ".metadata"

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATH_CLASSES = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")
_OTHER_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): get_layout,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class _ForeignGlobal(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _metadata_global(module: str, name: str) -> Any:
    """The classes and functions DCP metadata is built from; ``None`` for anything else."""
    if (module, name) in _OTHER_GLOBALS:
        return _OTHER_GLOBALS[module, name]
    if not name.isidentifier():  # no dotted paths into other objects
        return None
    if module == "torch":
        value = getattr(torch, name, None)
        return value if isinstance(value, torch.dtype) else None
    if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:
        return getattr(pathlib, name)
    if module in _DCP_MODULES:
        value = getattr(importlib.import_module(module), name, None)
        is_data = isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
        if is_data and value.__module__ == module:
            return value
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        value = _metadata_global(module, name)
        if value is None:
            raise _ForeignGlobal(f"{module}.{name}")
        return value

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent IDs are not used by DCP metadata")


def read_dcp_metadata(checkpoint: Any) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint directory ``checkpoint`` (a path, a URL or its
    :class:`~fsdp_strategy.checkpoint.storage.CheckpointFiles`), unpickled without running code stored in it."""
    files = checkpoint_files(checkpoint)
    path, name = files.name, DCP_METADATA_FILENAME
    data = read_checkpoint_file(files, name)
    not_dcp = f"'{name}' is not a Distributed Checkpoint metadata file"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _ForeignGlobal as error:
        raise damaged(
            path, name, f"{not_dcp} (it refers to {error.name}, which DCP metadata never contains; not unpickled)."
        ) from None
    except Exception as error:  # any malformed pickle: UnpicklingError, EOFError, TypeError, ...
        raise damaged(path, name, f"{not_dcp} (unreadable pickle data: {first_line(error).rstrip('.')}).") from error
    if not isinstance(metadata, Metadata):
        kind = type(metadata).__qualname__
        raise damaged(path, name, f"{not_dcp} (it holds a {kind}, not a {Metadata.__module__}.Metadata).")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise damaged(path, name, f"{not_dcp} (its state_dict_metadata is not a dict).")
    return metadata
