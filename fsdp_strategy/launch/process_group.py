"""``ProcessGroup``: the strategy's process group and what it knows about its peers.

Joining (through :mod:`.rendezvous`, which names a rank that never arrives), the collectives Lightning asks
a strategy for (``barrier``, ``broadcast``), a gloo group for small records read on the host, the note that
names a lost peer under a failed collective, and whether a stage ended normally on every rank.
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from fsdp_strategy.launch import rendezvous

__all__ = ["ProcessGroup", "is_initialized"]

_log = logging.getLogger(__name__)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class ProcessGroup:
    """The default process group as one strategy uses it; ``name`` (the strategy's) goes into messages."""

    def __init__(self, *, name: str, timeout: timedelta, backend: str | None) -> None:
        self.name = name
        self.timeout = timeout
        self.backend = backend  # None until start(): "nccl" on CUDA, "gloo" on CPU
        self.membership: rendezvous.Membership | None = None
        self.peer_lost = False
        self.stages_ended = 0  # names each stage's ending in the rendezvous store
        self._host_group: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # Store connections and process groups of this process: a pickled Trainer leaves them out.
        return {**self.__dict__, "membership": None, "_host_group": None}

    def start(
        self,
        environment: ClusterEnvironment,
        *,
        member: rendezvous.Member,
        processes_per_node: int,
        device: torch.device,
    ) -> None:
        """Joins the default group, or (a later stage with the same strategy) resumes the heartbeats."""
        backend = self.backend = self.backend or ("nccl" if device.type == "cuda" else "gloo")
        self.peer_lost = False
        rendezvous.finish_collectives_at_exit()
        if is_initialized():
            if self.membership is not None:
                self.membership.start()
            return
        # Other libraries (and Lightning's own helpers) read the rendezvous address from the environment.
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        world_size = environment.world_size()
        self.membership = rendezvous.join(
            address=environment.main_address,
            port=environment.main_port,
            me=member,
            world_size=world_size,
            processes_per_node=processes_per_node,
            backend=backend,
            timeout=self.timeout,
            device_id=device if device.type != "cpu" else None,
        )
        if backend == "nccl":  # torch warns about NCCL groups left to exit
            # A plain function, registered once: the handler must not keep this strategy (and its module) alive.
            atexit.unregister(_destroy_process_group_at_exit)
            atexit.register(_destroy_process_group_at_exit)
        rank_zero_info(f"{self.name}: {world_size} processes joined ({backend}).")

    def stop(self) -> None:
        if self.membership is not None:
            self.membership.stop()

    def on_step(self, step: int) -> None:
        if self.membership is not None:
            self.membership.step = step

    def host_group(self) -> Any:
        """For small records read on the host (unused parameters): a gloo group keeps them off the GPU streams."""
        if dist.get_backend() == "gloo":
            return None
        if self._host_group is None:
            self._host_group = dist.new_group(backend="gloo")
        return self._host_group

    def barrier(self, device: torch.device) -> None:
        if not is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @staticmethod
    def add_notes(exception: BaseException, notes: list[str | None]) -> None:
        for note in notes:
            if note is not None and hasattr(exception, "add_note"):  # Python >= 3.11 prints notes under the traceback
                exception.add_note(note)
            elif note is not None:
                _log.error(note)

    def diagnose(self, exception: BaseException, *, rank: int) -> str | None:
        """A lost peer surfaces as a transport error ("Connection reset by peer") that names no rank; the
        heartbeats tell which rank stopped. ``None``: not a failed collective of this group."""
        if self.membership is None or not rendezvous.is_communication_failure(exception):
            return None
        self.peer_lost = _EXIT.peer_lost = True
        diagnosis = f"{self.membership.diagnose()} {rendezvous.advice()}"
        return f"[rank {rank}] {self.name}: a collective failed. {diagnosis}"

    def stage_ended_on_every_rank(self, ended_here: bool, *, world_size: int) -> bool:
        """Whether every rank ended the stage normally; ``False`` at once after a lost peer."""
        if self.peer_lost:
            return False
        if self.membership is None or world_size == 1:  # a process group this strategy did not join
            return ended_here
        self.stages_ended += 1
        return self.membership.all_ok(
            f"stage_end/{self.stages_ended}", ended_here, timeout=self.timeout.total_seconds()
        )


@dataclass
class _ExitState:
    peer_lost: bool = False  # in any fit of this process: destroying the group could then block


_EXIT = _ExitState()


def _destroy_process_group_at_exit() -> None:
    if not _EXIT.peer_lost and is_initialized():
        dist.destroy_process_group()
