"""A model class named on the command line as ``MODULE:Class`` (``fsdp-strategy estimate``, ``benchmark``)."""

from __future__ import annotations

import importlib
import os
import sys

from torch import nn

__all__ = ["load_target"]


def load_target(target: str | type[nn.Module]) -> type[nn.Module]:
    """The module class named by ``"package.module:Class"`` (the current directory is importable)."""
    if isinstance(target, type):
        cls = target
    elif isinstance(target, str) and target.count(":") == 1 and all(target.split(":")):
        module_name, _, attribute = target.partition(":")
        if os.getcwd() not in sys.path and "" not in sys.path:  # a console script does not add it
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(
                f"Could not import {module_name!r} for {target!r}: {exc}. MODULE must be importable from the"
                " current directory or the Python path."
            ) from exc
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
