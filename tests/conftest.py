"""Shared fixtures: a real 1-rank gloo process group, and a clean environment for in-process Trainers.

No part of torch.distributed is mocked: collectives, DTensors and Distributed Checkpoint run for real
on a world of one process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from testkit import free_port

# Environment variables that Lightning's launcher writes into os.environ. A LOCAL_RANK left behind by
# one in-process Trainer would make the next one believe that its processes were launched externally.
_LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")


def _refuse_existing_group() -> None:
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "A default process group already exists before this test started; an earlier test leaked it."
            " Fixtures here create and destroy their own group and refuse to share one."
        )


def _destroy_group_if_any() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> Iterator[None]:
    """Every test starts and ends without a default process group."""
    _refuse_existing_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("The test left a default process group behind (now destroyed).")


@pytest.fixture
def single_rank_group() -> Iterator[dist.ProcessGroup]:
    """A real gloo default process group of world size 1, on a free port."""
    _refuse_existing_group()
    store = dist.TCPStore("127.0.0.1", 0, 1, True)  # port 0: the OS picks a free one
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        _destroy_group_if_any()  # also cleans up a group that an in-process Trainer reused or replaced


@pytest.fixture
def mesh(single_rank_group: dist.ProcessGroup):
    """The 1-D ``("dp_shard",)`` mesh over the single rank, as the strategy builds it."""
    from fsdp_strategy.sharding.mesh import build_device_mesh

    return build_device_mesh("cpu", 1, 1)


class TrainerEnv:
    """Handle given to tests by the ``trainer_env`` fixture."""

    def __init__(self) -> None:
        self._saved = dict(os.environ)
        self.fresh()

    def fresh(self) -> None:
        """Destroys the group of a previous in-process Trainer and gives the next one a new port."""
        _destroy_group_if_any()
        os.environ.clear()
        os.environ.update(self._saved)
        for name in _LAUNCHER_VARIABLES:
            os.environ.pop(name, None)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())

    def restore(self) -> None:
        _destroy_group_if_any()
        os.environ.clear()
        os.environ.update(self._saved)


@pytest.fixture
def trainer_env() -> Iterator[TrainerEnv]:
    """For an in-process ``Trainer(devices=1)`` with the strategy.

    Lightning initializes the default group itself from MASTER_ADDR/MASTER_PORT; each Trainer gets
    its own free port (call ``trainer_env.fresh()`` between two Trainers in one test), and the group
    plus every launcher variable are removed afterwards, also when the Trainer failed.
    """
    _refuse_existing_group()
    threads = torch.get_num_threads()
    env = TrainerEnv()
    try:
        yield env
    finally:
        env.restore()
        torch.set_num_threads(threads)
