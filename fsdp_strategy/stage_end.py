"""The end of a stage (the strategy's ``teardown``): what is settled and given back on every rank together, and
what is closed whatever happened.

Settling a background save and gathering the module are collectives, so they run only when every rank ended the
stage normally; an exception on one rank alone (in a rank-0-only callback, say) leaves the others there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

    from fsdp_strategy.checkpoint.manager import CheckpointManager
    from fsdp_strategy.launch.process_group import ProcessGroup
    from fsdp_strategy.step.hooks import StepHooks

__all__ = ["end_stage", "logged_after_an_error", "teardown_keeping_module"]

_log = logging.getLogger(__name__)


def end_stage(
    *,
    ended_here: bool,
    world_size: int,
    checkpoints: CheckpointManager,
    step_hooks: StepHooks,
    processes: ProcessGroup,
    give_back: Callable[[], None],
) -> None:
    """When the stage ended normally on every rank (``ended_here`` on each of the ``world_size`` ranks), waits for
    the last save and runs ``give_back``; then, also after a failure, closes the stage's step hooks, the
    checkpoints' background saver and the process group."""
    ended = processes.stage_ended_on_every_rank(ended_here, world_size=world_size)
    try:
        if ended:
            checkpoints.wait()  # a failed background save raises here, on every rank
            step_hooks.stage_ended()
            give_back()
    except BaseException:
        ended = False  # nothing more is waited for
        raise
    finally:  # the unused-parameter hooks would keep the module alive
        step_hooks.close(wait=ended)
        if not processes.peer_lost:
            checkpoints.close()
        processes.stop()


@contextmanager
def logged_after_an_error(interrupted: bool, *, who: str) -> Iterator[None]:
    """After the user's error (``interrupted``), which Lightning raises again once teardown returns, a failure of the
    teardown too is logged instead of raised over it: the user's error stays in view."""
    try:
        yield
    except Exception as error:  # noqa: BLE001
        if not interrupted:
            raise
        _log.warning(f"{who}: teardown after the error above failed too: {error!r}")


def teardown_keeping_module(strategy: ParallelStrategy) -> None:
    """Lightning's ``ParallelStrategy.teardown`` without moving the module and optimizer states to the CPU: for a
    module that still has meta tensors, which cannot be moved (an error came before ``setup()`` materialized it)."""
    assert strategy.cluster_environment is not None and strategy.accelerator is not None
    strategy.cluster_environment.teardown()
    strategy.precision_plugin.teardown()
    strategy.accelerator.teardown()
    strategy.checkpoint_io.teardown()
