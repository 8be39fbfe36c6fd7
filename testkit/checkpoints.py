"""Comparing checkpoint contents: exact structure and values, tensors bit for bit (shared by the unit and
integration tests of consolidation)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["assert_same"]


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Equal structure and values; tensors bit for bit with the same dtype and shape; no DTensors."""
    if isinstance(expected, torch.Tensor):
        assert type(actual) is torch.Tensor, where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}/{i}")
    else:
        assert type(actual) is type(expected) and actual == expected, where
