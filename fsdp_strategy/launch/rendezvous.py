"""Joining the process group so that failures have names.

``torch.distributed``'s own ``env://`` rendezvous waits silently for peers that never come and, after an
elastic restart on gloo, can read keys the dead attempt left in the agent's store (see the field notes).
:func:`join` therefore builds the process group on its own store view:

* a per-attempt key prefix (``TORCHELASTIC_RESTART_COUNT``), so a restarted job never sees its
  predecessor's keys;
* a roster: every rank announces itself (node, local rank, host, pid) and waits, until the timeout, for
  the others; a rank that never arrives is named;
* a heartbeat: a background thread bumps a per-rank counter (and records the global step), so that when a
  collective fails, :meth:`Membership.diagnose` tells which ranks stopped and which are merely behind;
* a clean end of the process: :func:`finish_collectives_at_exit`.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Member",
    "Membership",
    "PeerLostError",
    "all_ranks_agree",
    "finish_collectives_at_exit",
    "join",
    "on_rank_zero",
]

# How long the end of the process lets the collectives' threads run: they need the GIL for microseconds after the
# last collective completed (docs/gloo_exit_abort.py).
COLLECTIVE_THREADS_GRACE_S = 0.05


def finish_collectives_at_exit() -> None:
    """Registers, once per process, an exit handler that lets gloo's worker threads finish before Python finalizes.

    A gloo worker thread destroys each collective's work object after completing it, and a barrier's holds the
    works queued before it; releasing their tensors takes the GIL. When that happens after the script's last line,
    while the interpreter finalizes, Python makes the thread exit instead, the forced unwind meets a C++ destructor
    that may not throw, and std::terminate aborts the process ("terminate called without an active exception",
    exit status -6 after a successful run; ``docs/gloo_exit_abort.py`` shows it with torch alone, in about half of
    the launches). Exit handlers run while threads may still take the GIL: sleeping in one releases it for them.
    """
    atexit.unregister(_let_collective_threads_finish)
    atexit.register(_let_collective_threads_finish)


def _let_collective_threads_finish() -> None:
    time.sleep(COLLECTIVE_THREADS_GRACE_S)


_PREFIX = "fsdp_strategy"
_ROSTER_POLL_SECONDS = 0.2
# A live rank on a loaded machine can miss a beat or two; a shorter window would call it lost.
_MIN_DIAGNOSIS_WINDOW = 3.0


class PeerLostError(RuntimeError):
    """A rank or node did not join the job in time, or left it while it ran."""


@dataclass(frozen=True)
class Member:
    rank: int
    node_rank: int
    local_rank: int
    host: str
    pid: int

    def describe(self) -> str:
        return (
            f"rank {self.rank} (node {self.node_rank}, local rank {self.local_rank}, host {self.host}, pid {self.pid})"
        )


def heartbeat_interval(timeout: timedelta) -> float:
    """Often enough that a diagnosis takes a small part of the timeout; rarely enough to cost nothing."""
    return min(5.0, max(0.25, timeout.total_seconds() / 20))


class Membership:
    """This rank's view of the other ranks, kept current by a heartbeat thread."""

    def __init__(
        self, store: dist.Store, me: Member, members: dict[int, Member], interval: float, agent_store: bool
    ) -> None:
        self.me = me
        self.members = members
        self.interval = interval
        self.store_owner, self.store_gone = _store_owner(agent_store)
        self.step = 0  # written by the training thread, read by the heartbeat
        self.window = max(2.5 * interval, _MIN_DIAGNOSIS_WINDOW)
        self._store = store
        self._probe: dist.Store | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts (or restarts, after :meth:`stop`) the heartbeat thread."""
        if self._thread is not None and self._thread.is_alive() and not self._stop.is_set():
            return
        self.stop()
        self._stop = threading.Event()
        # Connections are opened now, while the store is alive: connecting to a dead store retries until the
        # full timeout. One TCPStore client is not shared across threads, so the heartbeat has its own.
        short = timedelta(seconds=max(2.0, 2 * self.interval))
        self._probe = self._store.clone()
        self._probe.set_timeout(short)
        store = self._store.clone()
        store.set_timeout(short)
        self._thread = threading.Thread(
            target=self._beat, args=(store, self._stop), name="fsdp2-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=4 * self.interval + 2)  # at most one store call with the short timeout

    def _beat(self, store: dist.Store, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                store.add(f"heartbeat/{self.me.rank}", 1)
                store.set(f"step/{self.me.rank}", str(self.step))
            except Exception:  # the store host is gone; diagnose() reports it
                return
            stop.wait(self.interval)

    def all_ok(self, name: str, ok: bool, *, timeout: float) -> bool:
        """Whether every rank is ``ok`` at the point called ``name``: decided alike on every rank through the store,
        without a collective, so that ranks that ended a stage differently never meet in one.

        A rank that is not ok answers and returns at once. The others wait for every answer, at most ``timeout``
        seconds, and give up early on a rank whose heartbeat stops: it will never answer.
        """
        store = self._probe if self._probe is not None else self._store
        store.set(f"{name}/{self.me.rank}", "1" if ok else "0")
        if not ok:
            return False
        keys = [f"{name}/{rank}" for rank in self.members]
        others = [rank for rank in self.members if rank != self.me.rank]
        deadline = time.monotonic() + timeout
        beats, checked = _counters(store, others), time.monotonic()
        while not store.check(keys):
            if time.monotonic() > deadline:
                return False
            if time.monotonic() - checked > self.window:
                now = _counters(store, others)
                if any(now[rank] <= beats[rank] and not store.check([f"{name}/{rank}"]) for rank in others):
                    return False
                beats, checked = now, time.monotonic()
            time.sleep(0.02)
        return all(store.get(key) == b"1" for key in keys)

    def diagnose(self) -> str:
        """Which ranks stopped beating over the next few intervals, and where the live ones are."""
        others = [rank for rank in self.members if rank != self.me.rank]
        store = self._probe
        if store is None:
            return "The heartbeats were not running, so the lost rank cannot be told."
        try:
            before = _counters(store, others)
            time.sleep(self.window)
            after = _counters(store, others)
            steps = {rank: _read_int(store, f"step/{rank}") for rank in others}
        except Exception as exc:
            return (
                f"The rendezvous store of {self.store_owner} cannot be reached any more ({type(exc).__name__}):"
                f" {self.store_gone}"
            )
        lost = [rank for rank in others if after[rank] <= before[rank]]
        if lost:
            return self._lost_message(lost)
        steps[self.me.rank] = self.step
        return _behind_message(steps)

    def _lost_message(self, lost: list[int]) -> str:
        whole_nodes = sorted(
            {self.members[rank].node_rank for rank in lost}
            - {m.node_rank for m in self.members.values() if m.rank not in lost}
        )
        node_note = (
            f" Every rank of node {', '.join(map(str, whole_nodes))} is gone: that node was probably lost."
            if whole_nodes
            else ""
        )
        return (
            f"Lost {len(lost)} of {len(self.members)} ranks: "
            + "; ".join(self.members[rank].describe() for rank in lost)
            + f" stopped responding (no heartbeat for {self.window:.1f} s).{node_note}"
        )


def _behind_message(steps: dict[int, int | None]) -> str:
    known = {rank: step for rank, step in steps.items() if step is not None}
    furthest = max(known.values(), default=0)
    behind = sorted(rank for rank, step in known.items() if step < furthest)
    progress = ", ".join(f"rank {rank}: {steps[rank]}" for rank in sorted(steps))
    detail = ""
    if len(behind) == 1:
        detail = f" Rank {behind[0]} is behind."
    elif behind:
        detail = f" Ranks {', '.join(map(str, behind))} are behind."
    return (
        "Every rank is still alive, so one of them did not reach the same collective in time (stuck, much"
        f" slower, or on a different code path). Global step per rank: {progress}.{detail}"
    )


def join(
    *,
    address: str,
    port: int,
    me: Member,
    world_size: int,
    processes_per_node: int,
    backend: str,
    timeout: timedelta,
    device_id: torch.device | None = None,
) -> Membership:
    """Connects to the store, waits for every rank (naming the missing ones), and creates the default group."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    base = _connect(
        address, port, me, world_size, timeout, host=not agent_store and me.rank == 0, agent_store=agent_store
    )
    store = dist.PrefixStore(f"{_PREFIX}/attempt_{attempt}", base)
    members = _wait_for_roster(store, me, world_size, processes_per_node, timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("process_group", store),
        rank=me.rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
    membership = Membership(store, me, members, heartbeat_interval(timeout), agent_store)
    membership.start()
    return membership


def this_member(rank: int, node_rank: int, local_rank: int) -> Member:
    return Member(rank=rank, node_rank=node_rank, local_rank=local_rank, host=socket.gethostname(), pid=os.getpid())


def _connect(
    address: str, port: int, me: Member, world_size: int, timeout: timedelta, *, host: bool, agent_store: bool
) -> dist.Store:
    try:
        return dist.TCPStore(address, port, world_size, is_master=host, timeout=timeout, wait_for_workers=False)
    except Exception as exc:
        if host:
            raise PeerLostError(
                f"Rank 0 could not open the rendezvous store on {address}:{port} ({exc}). Another job may be using"
                " MASTER_PORT: pick a free port."
            ) from exc
        raise PeerLostError(
            f"{me.describe()} could not reach the rendezvous store of {_store_owner(agent_store)[0]} at {address}:{port} within"
            f" {timeout.total_seconds():g} s ({type(exc).__name__}). Rank 0 has not started, has died, or"
            " MASTER_ADDR/MASTER_PORT differ between nodes. Start every node with the same address and port;"
            " raise the strategy's `timeout` if nodes start far apart."
        ) from exc


def _store_owner(agent_store: bool) -> tuple[str, str]:
    """Who hosts the store, and what its disappearance means."""
    if agent_store:
        return "the torchrun agent of node 0", (
            "torchrun's agent closes its store when it stops or restarts the workers after a rank failed;"
            " the agent's log names that rank under 'Root Cause'."
        )
    return "rank 0 (node 0)", "rank 0 hosts it, so rank 0 (node 0) was lost."


def _wait_for_roster(
    store: dist.Store, me: Member, world_size: int, processes_per_node: int, timeout: timedelta
) -> dict[int, Member]:
    store.set(f"member/{me.rank}", json.dumps(asdict(me)))
    keys = {rank: f"member/{rank}" for rank in range(world_size)}
    deadline = time.monotonic() + timeout.total_seconds()
    missing = [rank for rank in keys if rank != me.rank]
    while missing:
        missing = [rank for rank in missing if not store.check([keys[rank]])]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise PeerLostError(_missing_message(store, me, world_size, processes_per_node, missing, timeout))
        time.sleep(_ROSTER_POLL_SECONDS)
    return {rank: Member(**json.loads(store.get(key))) for rank, key in keys.items()}


def _missing_message(
    store: dist.Store, me: Member, world_size: int, processes_per_node: int, missing: list[int], timeout: timedelta
) -> str:
    joined = [Member(**json.loads(store.get(f"member/{rank}"))) for rank in range(world_size) if rank not in missing]
    joined_text = "; ".join(m.describe() for m in joined)
    ranks = ", ".join(map(str, missing))
    nodes = sorted({rank // processes_per_node for rank in missing})
    return (
        f"Rank{'s' if len(missing) > 1 else ''} {ranks} (node {', '.join(map(str, nodes))}) of {world_size} did not join within"
        f" {timeout.total_seconds():g} s (seen from {me.describe()}). Joined: {joined_text}. A node that was never"
        " started, crashed while starting, or was given a different WORLD_SIZE/MASTER_ADDR/MASTER_PORT never"
        " arrives: check its log. Raise the strategy's `timeout` if nodes start far apart."
    )


def _counters(store: dist.Store, ranks: list[int]) -> dict[int, int]:
    # add(key, 0) reads a counter without waiting for it to exist.
    return {rank: store.add(f"heartbeat/{rank}", 0) for rank in ranks}


def _read_int(store: dist.Store, key: str) -> int | None:
    return int(store.get(key)) if store.check([key]) else None


def is_communication_failure(exception: BaseException) -> bool:
    """Collective and store errors; gloo raises plain ``RuntimeError`` with the transport's message."""
    if isinstance(exception, dist.DistError):
        return True
    text = str(exception)
    # Transport names only: a bare "timed out" also comes from DataLoader workers and user code.
    markers = (
        "gloo",
        "NCCL",
        "Connection reset",
        "Connection closed",
        "Connection refused",
        "recv operation",
        "send operation",
    )
    return isinstance(exception, RuntimeError) and any(marker in text for marker in markers)


def advice() -> str:
    """What to do after losing a peer; torchrun sets the restart variables when it will try again."""
    restarting = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < int(
        os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    )
    what = (
        'torchrun will restart the job; `trainer.fit(..., ckpt_path="last")` resumes it from the last complete checkpoint.'
        if restarting
        else 'Restart the job: with `torchrun --max-restarts N` and `trainer.fit(..., ckpt_path="last")` it resumes'
        " from the last complete checkpoint by itself."
    )
    return (
        f"{what} Look in the lost rank's own log for why it stopped (a SIGKILL without a traceback is usually the"
        " out-of-memory killer); if it was only slow, raise the strategy's `timeout`."
    )


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """``True`` only when ``flag`` is true on every rank (one all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def on_rank_zero(
    action: Callable[[], Any], error: Callable[[str], Exception], is_zero: bool, broadcast: Callable[[Any], Any]
) -> Any:
    """Runs ``action`` on rank 0 only (``None`` elsewhere). If it fails, every rank raises ``error(message)``:
    the others would otherwise wait for rank 0 in the next collective. ``broadcast`` sends rank 0's object."""
    result, message = None, None
    if is_zero:
        try:
            result = action()
        except Exception as exc:
            message = str(exc)
    message = broadcast(message)
    if message is not None:
        raise error(message)
    return result
