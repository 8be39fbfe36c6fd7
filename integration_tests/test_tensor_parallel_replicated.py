"""A module that nothing splits, under ``tensor_parallel_size`` above 1 on 4 gloo ranks, trains replicated over the
tensor-parallel ranks and sharded over the data-parallel ones, as under Lightning's ``ModelParallelStrategy`` with a
``configure_model`` that applies ``fully_shard`` over ``self.device_mesh["data_parallel"]`` only: to its parameters
and loss on the meshes (dp, tp) = (1, 4) and (2, 2), and under ``tensor_parallel_size="auto"`` (one node of 4 ranks:
(1, 4)), whether its ``configure_model`` reads the mesh or it has none. Rank 0 warns once, naming the fixes; the ranks
of a tensor-parallel group hold the same shards; ``fully_shard`` reduces over the data-parallel mesh only; the
checkpoint, a single file or a sharded one (consolidated), holds the trained parameters.
"""

from __future__ import annotations

import pytest
import torch

from integration_tests.conftest import max_relative_difference, torchrun

WORKER = "integration_tests.tensor_parallel_replicated_worker"
OURS = {  # run -> (its ModelParallelStrategy reference, data-parallel ranks)
    "fsdp2_tp4/reads": ("model_parallel_tp4/reads", 1),
    "fsdp2_tp2/reads": ("model_parallel_tp2/reads", 2),
    "fsdp2_auto/reads": ("model_parallel_tp4/reads", 1),
    "fsdp2_tp2/plain": ("model_parallel_tp2/reads", 2),
    "fsdp2_tp2_sharded/reads": ("model_parallel_tp2/reads", 2),  # a Distributed Checkpoint, consolidated
}
REFERENCES = ["model_parallel_tp4/reads", "model_parallel_tp2/reads"]


def warning(tensor: int, data_parallel: int, module: str) -> str:
    sharded = (
        f"sharded over the {data_parallel} data-parallel ranks only"
        if data_parallel > 1
        else "not sharded (the data-parallel dimension has 1 rank)"
    )
    return (
        f"FSDP2Strategy: `tensor_parallel_size={tensor}` with no tensor-parallel plan: {module} holds no DTensor from"
        " `configure_model()` and no Hugging Face model with a `config.base_model_tp_plan`, so it is replicated over"
        f" the {tensor} tensor-parallel ranks (each computes the same batches) and {sharded}. To shard it over all"
        ' ranks, set `tensor_parallel_size=1` (`strategy="fsdp2"` in place of `"fsdp2_tp"`); to split it, split its'
        " layers in the LightningModule's `configure_model()`, as for Lightning's ModelParallelStrategy:"
        ' `parallelize_module(layer, self.device_mesh["tensor_parallel"], {"proj_in": ColwiseParallel(),'
        ' "proj_out": RowwiseParallel()})` (torch.distributed.tensor.parallel).'
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("tensor_parallel_replicated")
    out = tmp_path / "results.pt"
    torchrun(WORKER, ["--runs", ",".join([*OURS, *REFERENCES]), "--out", str(out)], nproc=4, cwd=tmp_path)
    return torch.load(out)


@pytest.mark.parametrize("run", list(OURS))
def test_a_module_that_nothing_splits_trains_as_under_model_parallel_strategy(results: dict, run: str) -> None:
    ours, lightnings = results[run], results[OURS[run][0]]
    assert max_relative_difference(ours["params"], lightnings["params"]) <= 1e-5  # measured: 0.0
    assert ours["loss"] == pytest.approx(lightnings["loss"], rel=1e-5)
    assert ours["samplers"] == lightnings["samplers"]  # rank 0's: the data-parallel ranks split the data
    assert max_relative_difference(ours["params"], ours["start"]) > 1e-3  # it trained


@pytest.mark.parametrize("run", list(OURS))
def test_the_tensor_parallel_ranks_hold_replicas_and_fully_shard_reduces_over_data_parallel_only(
    results: dict, run: str
) -> None:
    ours, data_parallel = results[run], OURS[run][1]
    assert ours["replicas_equal"]
    assert ours["param_meshes"] == {(("data_parallel",), (data_parallel,))}
    if run.endswith("/reads"):
        assert ours["mesh_seen"] == {"data_parallel": data_parallel, "tensor_parallel": 4 // data_parallel}
    checkpoint = ours["checkpoint"]
    assert checkpoint.keys() == ours["params"].keys()
    assert all(torch.equal(checkpoint[name].float(), ours["params"][name]) for name in checkpoint)


@pytest.mark.parametrize("run", list(OURS))
def test_rank_zero_warns_once_naming_what_is_replicated_and_the_fixes(results: dict, run: str) -> None:
    data_parallel = OURS[run][1]
    module = "MeshReadingGPT" if run.endswith("/reads") else "TensorParallelGPT"
    assert results[run]["warnings"] == [[warning(4 // data_parallel, data_parallel, module)], [], [], []]
    for reference in REFERENCES:
        assert results[reference]["warnings"] == [[], [], [], []]
