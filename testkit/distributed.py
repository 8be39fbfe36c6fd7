"""Helpers for tests of sharded modules: a free port for a rendezvous and the full value of a tensor."""

from __future__ import annotations

import socket

import torch
from torch.distributed.tensor import DTensor

__all__ = ["free_port", "full"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from its shards (a collective), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
