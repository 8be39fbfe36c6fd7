"""Helpers for tests of sharded modules: a free port for a rendezvous, the full value of a tensor, and a worker's
end."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["free_port", "full", "run_worker_main"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from its shards (a collective), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run_worker_main(main: Callable[[], object]) -> None:
    """Runs a multi-process worker's ``main``; once it returned, ends the process without interpreter shutdown.

    On CPU a rank whose work was done, results written, now and then aborts during shutdown (SIGABRT,
    "terminate called without an active exception": gloo's threads releasing tensors after the interpreter is
    gone; docs/benchmarks.md, "A rank that aborts at exit"), and the launcher then fails the whole job. An error
    in ``main`` still ends the process as usual, with its traceback and exit code. Only for a worker whose launcher
    waits for every rank (torchrun, or pipes the other ranks inherit): a rank that ends at once no longer waits for
    the others the way interpreter shutdown did.
    """
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
