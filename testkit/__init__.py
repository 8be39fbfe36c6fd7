"""Tiny models and helpers shared by this project's unit tests, integration tests and benchmarks.

They live beside the package, not in it: nothing here is installed. pytest finds them through
``pythonpath`` in ``pyproject.toml``, workers started by torchrun through ``PYTHONPATH`` (the repository
root), and the scripts in ``benchmarks/`` put the repository root on ``sys.path`` themselves. ``faults``
patches ``builtins.open`` to inject write failures: test code only.
"""

from testkit.distributed import free_port, full

__all__ = ["free_port", "full"]
