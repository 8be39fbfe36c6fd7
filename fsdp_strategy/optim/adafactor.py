"""Placeholder: the distributed Adafactor steps are being written."""

from __future__ import annotations

from typing import Any

__all__ = ["check_torch", "check_transformers", "torch_step", "transformers_step"]


def check_torch(optimizer: Any) -> None:
    raise NotImplementedError


check_transformers = check_torch


def torch_step(optimizer: Any, closure: Any = None) -> Any:
    raise NotImplementedError


transformers_step = torch_step
