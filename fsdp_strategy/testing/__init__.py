"""Tiny models and helpers shared by this project's unit tests, integration tests and benchmarks.

Like ``lightning.pytorch.demos``, they ship with the package, so test code anywhere (a worker process
started by torchrun, a user's own test) imports them without editing ``sys.path``.
"""

from fsdp_strategy.testing.distributed import free_port, full

__all__ = ["free_port", "full"]
