"""The estimator and ``ShardingMonitor`` against a real 2 x 2 tensor-parallel run (4 gloo ranks,
``FSDP2Strategy(tensor_parallel_size=2)``, ``integration_tests.tensor_parallel_cost_worker``).

Per rank a parameter split over ``tensor_parallel`` holds a quarter of its elements, a replicated one (norms,
embeddings) a half; FSDP2 gathers and reduce-scatters each tensor-parallel rank's part over the data-parallel ranks,
and every Colwise -> Rowwise pair all-reduces activations in forward and backward. The measured side is what the
ranks hold and what the dispatcher sees the collectives move in the first optimizer step
(``testkit.collectives``); the estimated side is ``estimate_module`` of the live model (the monitor's) and
``fsdp_strategy.estimate`` of the same model built on the meta device, split by a plan of style strings (the GPT)
or by its Hugging Face ``base_model_tp_plan`` (the Llama), with the step traced on a batch of the same shape.
Model state is held to 1% as in ``test_estimate_accuracy`` (the estimate counts Adam's step counters, which the
measurement leaves out: 0.3% here), and communication must match exactly.
"""

from __future__ import annotations

import json

import pytest

from fsdp_strategy.estimator.report import estimate
from integration_tests.conftest import torchrun
from integration_tests.tensor_parallel_cost_worker import BATCH_SIZE
from testkit.models import SEQ
from testkit.tensor_parallel import plan_styles

RUNS = ("tp_fsdp", "tp", "hf")


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("tensor_parallel_costs")
    out = tmp_path / "measured.json"
    worker = "integration_tests.tensor_parallel_cost_worker"
    torchrun(worker, ["--runs", ",".join(RUNS), "--out", str(out)], nproc=4, cwd=tmp_path)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def planned() -> dict:
    """``fsdp_strategy.estimate`` of each model on the meta device, before any split, with the step traced."""
    common = {"world_sizes": [4], "strategies": ["fsdp2"], "tensor_parallel_size": 2, "batch_size": BATCH_SIZE}
    gpt = estimate(
        "testkit.tensor_parallel:TensorParallelGPT",
        init_args={"parallelize": "none"},  # configure_model leaves it whole: the plan says how it would split
        tensor_parallel_plan=plan_styles(),
        seq_len=SEQ,
        **common,
    )
    llama = estimate("testkit.hf:TinyLlama", seq_len=SEQ, **common)  # split by its own base_model_tp_plan
    return {"gpt": gpt.rows[0], "hf": llama.rows[0]}


def within_one_percent(estimated: int, held: int) -> bool:
    return abs(estimated - held) / held <= 0.01


@pytest.mark.parametrize("run", RUNS)
def test_the_live_estimate_matches_the_state_each_rank_holds_and_the_collectives_of_fsdp2(measured, run):
    result = measured[run]
    for held, live, moved in zip(result["held"], result["live_estimate"], result["collectives"]):
        assert live["mesh"] == [1, 2] and live["tensor_parallel"] == 2 and live["note"] == ""
        assert within_one_percent(live["model_state_bytes"], held), (live["model_state_bytes"], held)
        assert moved["c10d/all_gather"] == live["all_gather_bytes"]
        assert moved["c10d/reduce_scatter"] == live["reduce_scatter_bytes"]
    # the same shares on every rank: each holds one data-parallel shard of one tensor-parallel part
    assert len(set(result["held"])) == 1


@pytest.mark.parametrize(("run", "model"), [("tp", "gpt"), ("hf", "hf")])
def test_the_estimate_before_the_split_matches_the_run(measured, planned, run, model):
    # "tp" and "hf" are sharded by the strategy's own plan, which the meta-device estimate follows; "tp_fsdp" is
    # sharded in configure_model, where only the live estimate can know its units.
    result, row = measured[run], planned[model]
    assert row.note == ""  # the split is known: from the plan given, or from the Llama's base_model_tp_plan
    assert all(within_one_percent(row.model_state_bytes, held) for held in result["held"])
    for moved in result["collectives"]:
        assert moved["c10d/all_gather"] == row.all_gather_bytes
        assert moved["c10d/reduce_scatter"] == row.reduce_scatter_bytes


@pytest.mark.parametrize(("run", "model"), [("tp_fsdp", "gpt"), ("tp", "gpt"), ("hf", "hf")])
def test_the_traced_activation_all_reduce_is_what_the_tensor_parallel_ranks_all_reduce(measured, planned, run, model):
    expected = planned[model].tensor_parallel_all_reduce_bytes
    assert expected > 0
    # DTensor issues tensor parallelism's collectives as functional ops; FSDP2 issues c10d ones.
    assert [moved["functional/all_reduce"] for moved in measured[run]["collectives"]] == [expected] * 4


@pytest.mark.parametrize("run", RUNS)
def test_the_monitor_reports_the_two_by_two_mesh_and_the_live_figures(measured, run):
    summary, live = measured[f"{run}/monitor"], measured[run]["live_estimate"][0]
    assert summary["mesh"] == [1, 2, 2] and summary["world_size"] == 4
    assert summary["estimated_model_state_bytes"] == pytest.approx(summary["max_model_state_bytes"], rel=0.10)
    assert summary["all_gather_bytes"] == live["all_gather_bytes"]
    assert summary["reduce_scatter_bytes"] == live["reduce_scatter_bytes"]
    assert summary["tensor_parallel_all_reduce_bytes"] is None  # the monitor traces no batch: not estimated
