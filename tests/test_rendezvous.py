"""The rendezvous pieces on real stores (in-process HashStore and TCPStore; no process group needed)."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from fsdp_strategy.launch import rendezvous
from fsdp_strategy.launch.rendezvous import Member, Membership, PeerLostError
from testkit import free_port


def _member(rank: int, node_rank: int) -> Member:
    return Member(rank=rank, node_rank=node_rank, local_rank=rank % 2, host="host-a", pid=100 + rank)


def _membership(store: dist.Store, ranks: int = 2, per_node: int = 1, interval: float = 0.05) -> Membership:
    members = {rank: _member(rank, rank // per_node) for rank in range(ranks)}
    return Membership(store, members[0], members, interval, agent_store=False)


def test_ranks_that_never_join_are_named_with_their_node() -> None:
    store = dist.HashStore()
    store.set("member/1", '{"rank": 1, "node_rank": 0, "local_rank": 1, "host": "host-a", "pid": 101}')
    with pytest.raises(PeerLostError) as error:
        rendezvous._wait_for_roster(store, _member(0, 0), 4, 2, timedelta(seconds=0.3))
    assert str(error.value) == (
        "Ranks 2, 3 (node 1) of 4 did not join within 0.3 s (seen from rank 0 (node 0, local rank 0, host host-a,"
        " pid 100)). Joined: rank 0 (node 0, local rank 0, host host-a, pid 100); rank 1 (node 0, local rank 1,"
        " host host-a, pid 101). A node that was never started, crashed while starting, or was given a different"
        " WORLD_SIZE/MASTER_ADDR/MASTER_PORT never arrives: check its log. Raise the strategy's `timeout` if nodes"
        " start far apart."
    )


def test_the_roster_returns_every_member_once_all_have_joined() -> None:
    store = dist.HashStore()
    late = threading.Timer(
        0.3, lambda: store.set("member/1", '{"rank": 1, "node_rank": 1, "local_rank": 0, "host": "b", "pid": 7}')
    )
    late.start()
    members = rendezvous._wait_for_roster(store, _member(0, 0), 2, 1, timedelta(seconds=10))
    assert members == {0: _member(0, 0), 1: Member(rank=1, node_rank=1, local_rank=0, host="b", pid=7)}


def _diagnose_a_lost_peer() -> str:
    membership = _membership(dist.HashStore(), ranks=3, per_node=2)
    membership.members[2] = _member(2, 1)
    membership.start()
    try:
        return membership.diagnose()
    finally:
        membership.stop()


def _diagnose_live_peers() -> str:
    store = dist.HashStore()
    membership = _membership(store)
    membership.step = 5
    peer = _membership(store)  # rank 1's heartbeat, beating on the same store
    peer.me = peer.members[1]
    peer.step = 3
    peer.start()
    membership.start()
    try:
        return membership.diagnose()
    finally:
        peer.stop()
        membership.stop()


@pytest.fixture(scope="module")
def diagnoses() -> dict[str, str]:
    """Each diagnosis watches the heartbeats for its whole window (3 s at least); the two watch at the same time."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        lost, live = pool.submit(_diagnose_a_lost_peer), pool.submit(_diagnose_live_peers)
        return {"lost": lost.result(), "live": live.result()}


def test_a_peer_without_heartbeat_is_reported_lost_with_its_node(diagnoses) -> None:
    assert diagnoses["lost"] == (
        "Lost 2 of 3 ranks: rank 1 (node 0, local rank 1, host host-a, pid 101); rank 2 (node 1, local rank 0,"
        " host host-a, pid 102) stopped responding (no heartbeat for 3.0 s). Every rank of node 1 is gone: that"
        " node was probably lost."
    )


def test_without_heartbeats_the_diagnosis_says_it_cannot_tell() -> None:
    assert (
        _membership(dist.HashStore()).diagnose() == "The heartbeats were not running, so the lost rank cannot be told."
    )


def test_live_peers_are_told_apart_by_their_global_step(diagnoses) -> None:
    assert diagnoses["live"] == (
        "Every rank is still alive, so one of them did not reach the same collective in time (stuck, much slower,"
        " or on a different code path). Global step per rank: rank 0: 5, rank 1: 3. Rank 1 is behind."
    )


def test_a_vanished_store_means_its_host_was_lost_and_is_told_at_once() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    # A long timeout, like the strategy's default: reconnecting to a dead store would wait all of it.
    client = dist.TCPStore("127.0.0.1", server.port, 1, is_master=False, timeout=timedelta(seconds=600))
    membership = _membership(client)
    membership.start()
    del server
    started = time.monotonic()
    message = membership.diagnose()
    membership.stop()
    assert time.monotonic() - started < 60
    assert message == (
        "The rendezvous store of rank 0 (node 0) cannot be reached any more (DistNetworkError): rank 0 hosts it,"
        " so rank 0 (node 0) was lost."
    )


def test_an_unreachable_store_names_its_address_and_what_to_check() -> None:
    port = free_port()
    with pytest.raises(PeerLostError) as error:
        rendezvous._connect("127.0.0.1", port, _member(1, 1), 2, timedelta(seconds=1), host=False, agent_store=False)
    assert re.fullmatch(
        re.escape(
            f"rank 1 (node 1, local rank 1, host host-a, pid 101) could not reach the rendezvous store of rank 0"
            f" (node 0) at 127.0.0.1:{port} within 1 s ("
        )
        + r"\w+"
        + re.escape(
            "). Rank 0 has not started, has died, or MASTER_ADDR/MASTER_PORT differ between nodes. Start"
            " every node with the same address and port; raise the strategy's `timeout` if nodes start far"
            " apart."
        ),
        str(error.value),
    )


def test_the_heartbeat_counts_up_and_stops() -> None:
    store = dist.HashStore()
    membership = _membership(store, interval=0.02)
    membership.step = 9
    membership.start()
    threading.Event().wait(0.2)
    membership.stop()
    beats = store.add("heartbeat/0", 0)
    assert beats >= 2
    assert store.get("step/0") == b"9"
    threading.Event().wait(0.1)
    assert store.add("heartbeat/0", 0) == beats  # stopped
    membership.start()  # a later fit restarts it
    threading.Event().wait(0.1)
    membership.stop()
    assert store.add("heartbeat/0", 0) > beats


@pytest.mark.parametrize(
    ("exception", "expected"),
    [
        (RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"), True),
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation"), True),
        (RuntimeError("DataLoader timed out after 30 seconds"), False),
        (dist.DistBackendError("NCCL error"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("Connection reset"), False),
    ],
)
def test_communication_failures_are_recognized(exception: BaseException, expected: bool) -> None:
    assert rendezvous.is_communication_failure(exception) is expected


def test_heartbeat_interval_is_a_small_part_of_the_timeout() -> None:
    assert rendezvous.heartbeat_interval(timedelta(seconds=1800)) == 5.0
    assert rendezvous.heartbeat_interval(timedelta(seconds=20)) == 1.0
    assert rendezvous.heartbeat_interval(timedelta(seconds=1)) == 0.25


def test_advice_depends_on_whether_torchrun_will_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert rendezvous.advice().startswith('torchrun will restart the job; `trainer.fit(..., ckpt_path="last")`')
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert rendezvous.advice().startswith("Restart the job: with `torchrun --max-restarts N`")
