"""Gradient accumulation under hybrid sharding with ``sync_grads_each_micro_batch=True``: every micro-batch
reduce-scatters within a replica, and the all-reduce across replicas runs once per optimizer step, on the last
micro-batch. Compared with DDP (parameters) and with the default hybrid run, which reduces once per step
(the number of units that all-reduce), on 4 gloo ranks, 2 replicas x 2 shards, 4 micro-batches per step; and
with tensor parallelism on a 2 x 1 x 2 mesh (replicate, shard, tensor parallel), against 1-D fsdp2 on 2 ranks."""

from __future__ import annotations

import pytest
import torch

from fsdp_strategy.estimator.model_state import estimate_module
from fsdp_strategy.step.unused import supported as reduces_zeros_for_unused_parameters
from integration_tests.conftest import launch, max_relative_difference, torchrun
from testkit.models import TinyLM
from testkit.tensor_parallel import TensorParallelGPT, plan_styles

ACCUMULATE = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    args = ["--strategies", "fsdp2_replicate2_sync,fsdp2_replicate2,ddp", "--variants", "sgd_accumulate4"]
    return launch(args, tmp_path_factory.mktemp("hybrid_accumulation"), nproc=4)


def test_sharded_accumulation_reaches_the_parameters_of_ddp(results: dict) -> None:
    synced, reference = results["fsdp2_replicate2_sync/sgd_accumulate4"], results["ddp/sgd_accumulate4"]
    assert max_relative_difference(synced["params"], reference["params"]) <= 1e-5
    assert synced["losses"] == pytest.approx(reference["losses"], rel=1e-5)


def test_one_all_reduce_per_unit_and_step_and_a_reduce_scatter_per_micro_batch(results: dict) -> None:
    synced = results["fsdp2_replicate2_sync/sgd_accumulate4"]["collectives_per_step"]
    default = results["fsdp2_replicate2/sgd_accumulate4"]["collectives_per_step"]
    units = default["dp_replicate/all_reduce"]  # the default run reduces each unit once per step
    assert len(units) >= 6 and min(units) > 0
    assert synced["dp_replicate/all_reduce"] == units
    assert synced["dp_shard/reduce_scatter"] == [ACCUMULATE * n for n in default["dp_shard/reduce_scatter"]]
    assert default["dp_shard/reduce_scatter"] == units


@pytest.fixture(scope="module")
def tensor_parallel_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tensor-parallel GPT on a (dp_replicate, dp_shard, tensor_parallel) = (2, 1, 2) mesh, with and without
    the option, and plain under 1-D fsdp2 on 2 ranks (the same global batches)."""
    tmp_path = tmp_path_factory.mktemp("hybrid_tensor_parallel_accumulation")
    found = {}
    # One fit per launch: DTensor may run a later fit's tensor-parallel collectives over the groups of an earlier,
    # equal mesh of the same process, whose names the counter would not match.
    for index, (nproc, run) in enumerate(((4, HYBRID_TP_SYNC), (4, HYBRID_TP), (2, TP_REFERENCE))):
        out = tmp_path / f"results_{index}.pt"
        torchrun(TP_WORKER, ["--runs", run, "--out", str(out)], nproc=nproc, cwd=tmp_path)
        found.update(torch.load(out))
    return found


TP_WORKER = "integration_tests.tensor_parallel_worker"
HYBRID_TP_SYNC = f"fsdp2_hybrid_tp_sync/tp/noclip/accumulate={ACCUMULATE}"
HYBRID_TP = f"fsdp2_hybrid_tp/tp/noclip/accumulate={ACCUMULATE}"
TP_REFERENCE = f"fsdp2/none/noclip/accumulate={ACCUMULATE}"


def test_with_tensor_parallelism_it_reaches_the_parameters_of_a_one_dimensional_run(tensor_parallel_results) -> None:
    synced, reference = tensor_parallel_results[HYBRID_TP_SYNC], tensor_parallel_results[TP_REFERENCE]
    assert max_relative_difference(synced["params"], reference["params"]) <= 1e-5
    assert synced["loss"] == pytest.approx(reference["loss"], rel=1e-5)


def test_with_tensor_parallelism_one_all_reduce_per_unit_and_step(tensor_parallel_results) -> None:
    synced = tensor_parallel_results[HYBRID_TP_SYNC]["collectives_per_step"]
    default = tensor_parallel_results[HYBRID_TP]["collectives_per_step"]
    units = default["dp_replicate/all_reduce"]
    assert len(units) == 3 and min(units) > 0
    assert synced["dp_replicate/all_reduce"] == units
    # tensor parallelism's own all-reduces, in forward and backward of every micro-batch, are left as they were
    assert synced["tensor_parallel/all_reduce"] == default["tensor_parallel/all_reduce"]
    assert min(default["tensor_parallel/all_reduce"]) > 0


def test_with_tensor_parallelism_the_estimate_counts_the_all_reduce_issued(tensor_parallel_results) -> None:
    # The runs' module estimated from its shapes, split by the plan its configure_model applies.
    with torch.device("meta"):
        model = TensorParallelGPT("tp")
    for run, sync in ((HYBRID_TP_SYNC, True), (HYBRID_TP, False)):
        estimate = estimate_module(
            model,
            strategy="fsdp2_hybrid",
            world_size=4,
            processes_per_node=2,  # one node: 1 data-parallel shard x 2 tensor-parallel ranks
            precision="32-true",
            accumulate_grad_batches=ACCUMULATE,
            sync_grads_each_micro_batch=sync,
            tensor_parallel_size=2,
            tensor_parallel_plan=plan_styles(),
        )
        assert estimate.mesh == (2, 1), run
        measured = tensor_parallel_results[run]["collectives_per_step"]
        assert set(measured["dp_replicate/all_reduce/bytes"]) == {estimate.all_reduce_bytes}, run


@pytest.mark.skipif(
    not reduces_zeros_for_unused_parameters(),
    reason="torch < 2.13 cannot reduce-scatter zeros for parameters unused on some ranks (README: needs torch >= 2.13)",
)
def test_parameters_used_in_early_micro_batches_only_train_as_with_find_unused_parameters(tmp_path) -> None:
    # The unused-parameter record runs on the last micro-batch only, where the gradients reach param.grad: an
    # expert used in the first micro-batches of a step keeps the gradient of its partial sum. Even ranks never use
    # some experts, so every micro-batch's reduce-scatter needs torch 2.13's zeros for them.
    out = tmp_path / "results.pt"
    runs = "fsdp2_hybrid_sync/moe_sgd_accumulate4,ddp_find_unused_parameters_true/moe_sgd_accumulate4"
    torchrun("integration_tests.dropin_worker", ["--runs", runs, "--out", str(out)], nproc=4, cwd=tmp_path)
    results = torch.load(out)
    sharded = results["fsdp2_hybrid_sync/moe_sgd_accumulate4"]
    reference = results["ddp_find_unused_parameters_true/moe_sgd_accumulate4"]
    assert max_relative_difference(sharded["params"], reference["params"]) <= 1e-5


def test_the_estimate_counts_the_bytes_issued(results: dict) -> None:
    # TinyLM under the same options, estimated from its shapes; the runs' steps with all 4 micro-batches.
    with torch.device("meta"):
        model = TinyLM(optimizer="sgd")
    for run, sync in (("fsdp2_replicate2_sync", True), ("fsdp2_replicate2", False)):
        measured = results[f"{run}/sgd_accumulate4"]["collectives_per_step"]
        estimate = estimate_module(
            model,
            strategy="fsdp2_hybrid",
            world_size=4,
            processes_per_node=2,
            precision="32-true",
            optimizer="sgd",
            accumulate_grad_batches=ACCUMULATE,
            sync_grads_each_micro_batch=sync,
        )
        assert set(measured["dp_shard/reduce_scatter/bytes"]) == {estimate.reduce_scatter_bytes}, run
        assert set(measured["dp_replicate/all_reduce/bytes"]) == {estimate.all_reduce_bytes}, run
