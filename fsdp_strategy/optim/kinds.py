"""Which optimizers are exact on shards, which this package runs distributed, and which it refuses.

Under FSDP2 the optimizer steps each rank's shard of every parameter. That equals DDP's step only for an update
whose every element reads that element alone (and scalars all ranks share: the step count, the learning rate).
torch's own elementwise optimizers are known by their exact class, or a subclass whose ``step`` is theirs; the
optimizers whose update reads a whole matrix or its norms get a distributed step (:mod:`.install`); any other
class is refused before training unless the user declares it elementwise (``elementwise_optimizers``), since a
wrong guess trains silently differently from DDP.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Collection

from torch.optim import Optimizer

__all__ = [
    "ELEMENTWISE",
    "LOCAL_STEP",
    "REFUSED",
    "OptimizerKind",
    "UnsupportedOptimizerError",
    "class_path",
    "classify",
]


class OptimizerKind(enum.Enum):
    ELEMENTWISE = "elementwise"  # steps the shards as they are
    DISTRIBUTED = "distributed"  # a step of this package's in place of its own
    EMPTY = "empty"  # holds no parameter (Lightning's stand-in when configure_optimizers returns None)


class UnsupportedOptimizerError(ValueError):
    """An optimizer this strategy cannot step as DDP would, named with why and the fix."""


# Every update here reads each element of the parameter, its gradient and its state alone, plus the step count.
ELEMENTWISE = frozenset(
    f"torch.optim.{name}"
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "ASGD")
)

# Elementwise too, but stepped on local tensors: DTensor refuses some of their ops on a shard (optim/local_step.py).
LOCAL_STEP = frozenset({"torch.optim.Rprop"})

# Why and the fix, for the classes no distributed step exists for.
REFUSED = {
    "torch.optim.LBFGS": (
        "its closure's line search runs over all parameters flattened into one vector, which each rank holds only a"
        " shard of, and its data-dependent inner loop must take the same turns on every rank",
        'train it with `strategy="ddp"` (L-BFGS fits models small enough to replicate)',
    ),
    "torch.optim.SparseAdam": (
        "it needs sparse gradients (`nn.Embedding(sparse=True)`), and FSDP2 reduces dense gradient shards",
        'use a dense embedding with `torch.optim.Adam`, or `strategy="ddp"`',
    ),
}


def class_path(optimizer: Optimizer | type) -> str:
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    module = cls.__module__
    # torch.optim's classes live in private modules (torch.optim.adamw): name them as users import them.
    if module.startswith("torch.optim.") and getattr(__import__("torch").optim, cls.__name__, None) is cls:
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def classify(optimizer: Optimizer, *, distributed: Collection[str], declared: Collection[str]) -> OptimizerKind:
    """The kind of ``optimizer``: ``distributed`` and ``declared`` (``elementwise_optimizers``) hold class paths or
    names; raises :class:`UnsupportedOptimizerError` for a class that is neither known nor declared."""
    if not any(group["params"] for group in optimizer.param_groups):
        return OptimizerKind.EMPTY
    path = class_path(optimizer)
    name = type(optimizer).__name__
    if path in declared or name in declared:
        return OptimizerKind.ELEMENTWISE
    if path in distributed:
        return OptimizerKind.DISTRIBUTED
    if path in ELEMENTWISE or _steps_as(type(optimizer)) in ELEMENTWISE:
        return OptimizerKind.ELEMENTWISE
    if path in REFUSED:
        why, fix = REFUSED[path]
        raise UnsupportedOptimizerError(f"`{path}` cannot train under FSDP2 as under DDP: {why}. Instead, {fix}.")
    raise UnsupportedOptimizerError(
        f"`{path}` is not an optimizer this strategy knows to step shards as DDP steps whole parameters: under FSDP2"
        " each rank steps only its shard of every parameter, so an update that reads more than each element alone"
        " (a norm of the whole parameter or update, a trust ratio, a matrix function, a factored statistic) would"
        " silently train differently from DDP. If its update reads each element alone, as Adam's and SGD's do,"
        f' declare it: `FSDP2Strategy(elementwise_optimizers=["{name}"])`. Otherwise train it with'
        ' `strategy="ddp"`, or use one of the optimizers that run distributed: '
        + ", ".join(f"`{p}`" for p in sorted(distributed) if p not in LOCAL_STEP)
        + "."
    )


def _steps_as(cls: type) -> str | None:
    """The class path of the class whose ``step`` ``cls`` runs: a subclass that only adds options steps as its base.
    torch wraps a class's ``step`` for its profiler and hooks when it is first built, subclasses included, so the
    class that defined it is the most basic one whose ``step`` unwraps to the same function."""
    func = inspect.unwrap(cls.step)
    owner = next(
        (k for k in reversed(cls.__mro__) if "step" in vars(k) and inspect.unwrap(vars(k)["step"]) is func), None
    )
    return class_path(owner) if owner is not None else None
