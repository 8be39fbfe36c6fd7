"""A 2-node job on one machine: two torchrun invocations (``--nnodes 2 --node-rank 0/1``, 2 processes
each) that rendezvous on 127.0.0.1, training ``"ddp"``, ``"fsdp2"`` and ``"fsdp2_hybrid"`` in turn.

One job serves most tests (starting 4 processes on a small machine costs far more than training the
tiny model): ``"ddp"`` on the same 4 ranks is the reference for parity, and every rank reports what it
was told about the job (see ``integration_tests/multinode_worker.py``). One more job starts the same
worker with Lightning's launcher, for ``"fsdp2_hybrid"`` only.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from integration_tests.conftest import (
    lightning_nodes,
    max_relative_difference,
    run_nodes,
    torchrun_nodes,
)
from integration_tests.multinode_worker import BATCH_SIZE, EPOCHS, SAMPLES

NODES, DEVICES = 2, 2
WORKER = "integration_tests.multinode_worker"
STRATEGIES = ("ddp", "fsdp2", "fsdp2_hybrid")
# Where each rank must end up: (node, local rank) -> global rank.
GLOBAL_RANK = {(node, local): node * DEVICES + local for node in range(NODES) for local in range(DEVICES)}


def load_ranks(out_dir: Path, strategy: str) -> dict[tuple[int, int], dict]:
    """The per-rank reports of one strategy, keyed by the (node, local rank) that launched each process."""
    return {
        (node, local): torch.load(out_dir / f"{strategy}.node{node}.local{local}.pt", weights_only=False)
        for node, local in GLOBAL_RANK
    }


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    job_dir = tmp_path_factory.mktemp("two_nodes")
    out_dir = job_dir / "out"
    out_dir.mkdir()
    args = ["--strategies", ",".join(STRATEGIES), "--num-nodes", str(NODES), "--out-dir", str(out_dir)]
    outputs = torchrun_nodes(WORKER, args, nnodes=NODES, nproc_per_node=DEVICES, cwd=job_dir, timeout=300)
    return {
        "ranks": {strategy: load_ranks(out_dir, strategy) for strategy in STRATEGIES},
        "output": "\n".join(outputs),
        "dir": job_dir,
    }


# --- checks made on every launcher's job -----------------------------------------------------------------------


def assert_topology(ranks: dict[tuple[int, int], dict], strategy: str) -> None:
    """Ranks, world size, sampler and device mesh as each process reports them, node 1 included."""
    for (node, local), report in ranks.items():
        rank = GLOBAL_RANK[node, local]
        where = f"{strategy} on node {node}, local rank {local}"
        assert (report["node_rank"], report["local_rank"], report["global_rank"]) == (node, local, rank), where
        assert (report["world_size"], report["num_nodes"], report["process_group_size"]) == (4, NODES, 4), where
        assert report["process_group_rank"] == rank, where
        assert report["is_global_zero"] == (rank == 0), where
        assert report["rank_zero_only_rank"] == rank, where
        assert report["sampler"] == ("DistributedSampler", 4, rank, True), where
        if strategy == "fsdp2":
            assert report["mesh_shape"] == (4,) and report["mesh_dim_names"] == ("dp_shard",), where
            assert report["mesh_coordinate"] == (rank,), where
            assert report["placements"] == ["Shard"], where
        elif strategy == "fsdp2_hybrid":
            # Replicate across the nodes, shard within each: node 1 is replica 1, its shards are ranks 2 and 3.
            assert report["mesh_shape"] == (2, 2) and report["mesh_dim_names"] == ("dp_replicate", "dp_shard"), where
            assert report["mesh_coordinate"] == (node, local), where
            assert report["mesh_groups"] == {
                "dp_replicate": [local, DEVICES + local],
                "dp_shard": [2 * node, 2 * node + 1],
            }, where
            assert report["placements"] == ["Replicate", "Shard"], where
        else:
            assert report["mesh_shape"] is None, where


def assert_each_sample_once_per_epoch(ranks: dict[tuple[int, int], dict], strategy: str) -> None:
    seen = [pair for report in ranks.values() for pair in report["seen"]]
    orders = []
    for epoch in range(EPOCHS):
        indices = [index for e, index in seen if e == epoch]
        assert sorted(indices) == list(range(SAMPLES)), f"{strategy}, epoch {epoch}: samples seen {sorted(indices)}"
        orders.append([index for e, index in ranks[0, 0]["seen"] if e == epoch])
    assert orders[0] != orders[1], f"{strategy}: the sampler gave rank 0 the same order in both epochs"


def assert_logger_wrote_on_rank_zero_only(job_dir: Path, strategy: str) -> None:
    """Each process logs into its own ``node{N}/local{L}``: only global rank 0's may hold files."""
    written = sorted(str(p.relative_to(job_dir)) for p in job_dir.glob("node*/local*/**/*") if p.is_file())
    expected = f"node0/local0/{strategy}/version_0/metrics.csv"
    assert expected in written, written
    assert all(path.startswith("node0/local0/") for path in written), written


# --- the torchrun job ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp2_hybrid"])
def test_parity_with_ddp_on_two_nodes(torchrun_job: dict, strategy: str) -> None:
    sharded, reference = torchrun_job["ranks"][strategy], torchrun_job["ranks"]["ddp"]
    assert max_relative_difference(sharded[0, 0]["params"], reference[0, 0]["params"]) <= 1e-5
    for key in GLOBAL_RANK:
        assert len(sharded[key]["losses"]) == EPOCHS * SAMPLES // (4 * BATCH_SIZE), key
        assert sharded[key]["losses"] == pytest.approx(reference[key]["losses"], rel=1e-5), key


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_sample_once_per_epoch_across_nodes(torchrun_job: dict, strategy: str) -> None:
    assert_each_sample_once_per_epoch(torchrun_job["ranks"][strategy], strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ranks_sampler_and_mesh_on_both_nodes(torchrun_job: dict, strategy: str) -> None:
    assert_topology(torchrun_job["ranks"][strategy], strategy)


def test_model_state_is_sharded_within_a_node(torchrun_job: dict) -> None:
    """Each rank holds its 1/shard-size share: a quarter under "fsdp2", half under "fsdp2_hybrid"."""
    for strategy, shard_size in (("fsdp2", 4), ("fsdp2_hybrid", 2)):
        for key, report in torchrun_job["ranks"][strategy].items():
            held, share = report["state_bytes"], report["share_bytes"]
            assert held <= 1.01 * share[shard_size], (strategy, key, held, share)
            if shard_size == 2:  # replicated across the nodes, so not a quarter
                assert held > 1.01 * share[4], (strategy, key, held, share)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rank_zero_only_output_and_logger_files(torchrun_job: dict, strategy: str) -> None:
    output = torchrun_job["output"]
    assert output.count(f"multinode_worker: {strategy} finished") == 1, output[-4000:]
    assert_logger_wrote_on_rank_zero_only(torchrun_job["dir"], strategy)
    if strategy != "ddp":  # the strategy's own rank_zero_info summary of the sharding plan
        mesh = "(replicate, shard) = (2, 2)" if strategy == "fsdp2_hybrid" else "4-way sharded"
        plan_lines = [line for line in output.splitlines() if line.startswith("FSDP2Strategy:") and mesh in line]
        assert len(plan_lines) == 1, output[-4000:]


# --- Lightning's own launcher: NODE_RANK, MASTER_ADDR and MASTER_PORT set on each node -----------------------


def test_lightning_launcher_on_two_nodes(tmp_path: Path) -> None:
    """Lightning starts each node's second process itself, and the strategy computes the global ranks
    from ``NODE_RANK`` (torchrun hands them over ready-made)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["--strategies", "fsdp2_hybrid", "--num-nodes", str(NODES), "--out-dir", str(out_dir)]
    outputs = lightning_nodes(WORKER, args, nnodes=NODES, devices=DEVICES, cwd=tmp_path, timeout=300)
    ranks = load_ranks(out_dir, "fsdp2_hybrid")
    assert_topology(ranks, "fsdp2_hybrid")
    assert_each_sample_once_per_epoch(ranks, "fsdp2_hybrid")
    assert "\n".join(outputs).count("multinode_worker: fsdp2_hybrid finished") == 1
    assert_logger_wrote_on_rank_zero_only(tmp_path, "fsdp2_hybrid")


def test_a_failed_node_ends_the_job_with_every_nodes_output(tmp_path: Path) -> None:
    """The launch helper itself: a node that fails must not leave its peer waiting for it."""
    failing = [sys.executable, "-c", "import sys; print('node 0 gives up'); sys.exit(3)"]
    waiting = [sys.executable, "-c", "import time; print('node 1 waits for its peer', flush=True); time.sleep(600)"]
    start = time.monotonic()
    with pytest.raises(AssertionError) as error:
        run_nodes([failing, waiting], cwd=tmp_path, envs=[dict(os.environ)] * 2, timeout=120)
    assert time.monotonic() - start < 60
    message = str(error.value)
    assert "exited with 3" in message and "exited with -9" in message, message
    assert "node 0 gives up" in message and "node 1 waits for its peer" in message, message
