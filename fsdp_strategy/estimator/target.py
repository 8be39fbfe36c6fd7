"""A model class named on the command line as ``MODULE:Class`` (``fsdp-strategy estimate``, ``benchmark``), or a
Hugging Face weights directory, whose modules and parameters are read from the safetensors headers."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_strategy.checkpoint.pretrained import read_headers

__all__ = ["load_function", "load_target", "weights_skeleton"]


def _import(target: str) -> tuple[Any, str]:
    """The module named before the colon of ``"package.module:name"``, and the name after it."""
    module_name, _, attribute = target.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # a console script does not add it
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name), attribute
    except ImportError as exc:
        raise ValueError(
            f"Could not import {module_name!r} for {target!r}: {exc}. MODULE must be importable from the"
            " current directory or the Python path."
        ) from exc


def _is_target(text: Any) -> bool:
    return isinstance(text, str) and text.count(":") == 1 and all(text.split(":"))


def load_function(target: str, *, option: str) -> Callable[..., Any]:
    """The function named by ``"package.module:function"`` (``option`` names the argument in errors)."""
    if not _is_target(target):
        raise ValueError(f"`{option}` must be given as 'MODULE:function' or a callable; got {target!r}.")
    module, attribute = _import(target)
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"`{option}`: {target!r} must name a function in {module.__name__!r}; got {function!r}.")
    return function


def load_target(target: str | type[nn.Module]) -> type[nn.Module]:
    """The module class named by ``"package.module:Class"`` (the current directory is importable)."""
    if isinstance(target, type):
        cls = target
    elif _is_target(target):
        module, attribute = _import(target)
        module_name = module.__name__
        cls = getattr(module, attribute, None)
        if cls is None:
            classes = [n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, nn.Module)]
            raise ValueError(
                f"{module_name!r} has no attribute {attribute!r}; its nn.Module classes are:"
                f" {', '.join(sorted(classes)) or 'none'}."
            )
    else:
        raise ValueError(
            f"The model must be given as 'MODULE:Class' (for example 'examples.gpt:GPT') or a class; got {target!r}."
        )
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"{target!r} must name a torch.nn.Module subclass; it is {cls!r}.")
    return cls


class WeightsModule(nn.Module):
    """A module of a weights directory's tree: only parameters, no forward (a name's dotted parts are modules)."""


def weights_skeleton(directory: str | os.PathLike) -> nn.Module:
    """The modules and parameters a Hugging Face weights directory holds, on the meta device, from the safetensors
    headers alone (no tensor data is read): each tensor a parameter of its name's shape and dtype, numbered parts
    (``layers.0``) children of an ``nn.ModuleList``, so ``wrap_policy="auto"`` finds the repeated blocks.
    A tied parameter the files leave out (``lm_head.weight``) is left out, as it is one parameter."""
    root = WeightsModule()
    for name, header in read_headers(directory).items():
        *path, leaf = name.split(".")
        module: nn.Module = root
        for part, following in zip(path, [*path[1:], leaf]):
            if part not in module._modules:
                child = nn.ModuleList() if following.isdigit() else WeightsModule()
                if part.isdigit():
                    module.append(child)  # type: ignore[operator]
                else:
                    module.add_module(part, child)
            module = module._modules[part]  # type: ignore[assignment]
        module.register_parameter(leaf, nn.Parameter(torch.empty(header.shape, dtype=header.dtype, device="meta")))
    return root
