"""The estimator under ``tensor_parallel_size``: which parameters are split (a Hugging Face ``base_model_tp_plan``, a
plan given by name, or a live module's DTensor placements on a 1-rank gloo mesh), the bytes per rank that follow,
the activation all-reduce counted from a traced step, the CLI option, the table and the monitor's summary line."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from fsdp_strategy.estimator.model_state import estimate_module
from fsdp_strategy.estimator.report import estimate
from fsdp_strategy.estimator.tensor_split import tensor_splits
from fsdp_strategy.monitor.summary import format_summary, summarize
from fsdp_strategy.sharding.mesh import DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM
from fsdp_strategy.sharding.tensor_parallel import apply_tensor_parallel_plan
from fsdp_strategy.tools.cli import main
from testkit.hf import TinyLlama
from testkit.models import SEQ
from testkit.tensor_parallel import GPT, plan_styles, tensor_parallel_plan

F32 = 4


def meta(cls: type[nn.Module] = GPT) -> nn.Module:
    with torch.device("meta"):
        return cls()


def test_a_split_parameter_holds_a_quarter_per_rank_and_a_replicated_one_a_half():
    model = meta(TinyLlama)
    splits = tensor_splits(model, 2)
    assert splits.known and splits.size == 2
    split = sum(p.numel() for p in model.parameters() if id(p) in splits.dims)
    replicated = sum(p.numel() for p in model.parameters() if id(p) not in splits.dims)
    assert split > 0 and replicated > 0  # the projections are split; norms and embeddings are not
    row = estimate_module(model, strategy="fsdp2", world_size=4, tensor_parallel_size=2)
    assert (row.mesh, row.tensor_parallel, row.note) == ((1, 2), 2, "")
    # TinyLlama's split and sharded dimensions are even: no padding
    assert row.param_bytes == (split // 4 + replicated // 2) * F32
    assert row.grad_bytes == row.param_bytes
    # FSDP2 gathers one tensor-parallel rank's part of every parameter, once in forward and once in backward (the
    # root twice, for the reason model_state gives): the split ones at half size.
    one_dimensional = estimate_module(model, strategy="fsdp2", world_size=2)
    assert row.all_gather_bytes < one_dimensional.all_gather_bytes
    assert row.tensor_parallel_all_reduce_bytes is None  # no batch traced: not estimated


def test_the_hugging_face_plan_splits_colwise_by_rows_and_rowwise_by_columns():
    model = meta(TinyLlama)
    splits = tensor_splits(model, 2)
    layer = model.model.model.layers[0]  # the LightningModule's LlamaForCausalLM's base model
    assert splits.dims[id(layer.self_attn.q_proj.weight)] == 0
    assert splits.dims[id(layer.self_attn.o_proj.weight)] == 1
    assert splits.dims[id(layer.mlp.down_proj.weight)] == 1
    assert id(layer.input_layernorm.weight) not in splits.dims
    first_layer = {name: style for name, style in splits.styles.items() if name.startswith("model.model.layers.0.")}
    assert first_layer == {
        f"model.model.layers.0.{name}": style
        for name, style in (("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"))
        + (("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"))
        + (("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise"))
    }


def test_a_module_without_a_plan_is_counted_replicated_and_says_so():
    model = meta()
    row = estimate_module(model, strategy="fsdp2", world_size=4, tensor_parallel_size=2)
    assert "the tensor-parallel split of GPT is not known" in row.note
    halved = estimate_module(model, strategy="fsdp2", world_size=2)  # the same as 2 data-parallel ranks alone
    assert row.model_state_bytes == halved.model_state_bytes


def test_a_plan_given_by_name_splits_as_configure_model_would(single_rank_group):
    twin = meta()
    styles = plan_styles(prefix="")
    planned = tensor_splits(twin, 2, plan_styles(prefix="blocks.*."))
    assert planned.styles == {f"blocks.{i}.{layer}": style for i in range(2) for layer, style in styles.items()}
    # the same module split for real: the placements on the tensor_parallel dimension say the same
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=(DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM))
    live = GPT()
    for block in live.blocks:
        parallelize_module(block, mesh[TENSOR_PARALLEL_DIM], tensor_parallel_plan())
    placed = tensor_splits(live, 2)
    assert placed.size == 1  # the mesh's own tensor_parallel size
    assert placed.styles == planned.styles
    live_names = {id(p): name for name, p in live.named_parameters()}
    by_name = dict(twin.named_parameters())
    assert {live_names[key]: dim for key, dim in placed.dims.items()} == {
        name: planned.dims[id(by_name[name])] for name in by_name if id(by_name[name]) in planned.dims
    }


def test_peft_lora_layers_are_counted_split_as_the_strategy_splits_them(single_rank_group):
    pytest.importorskip("peft")
    planned_model = TinyLlama(lora_targets=["q_proj", "o_proj"])
    planned = tensor_splits(planned_model, 2)
    # the same model split by the strategy: its placements are what the plan-read estimate must say
    live = TinyLlama(lora_targets=["q_proj", "o_proj"])
    apply_tensor_parallel_plan(live, init_device_mesh("cpu", (1,), mesh_dim_names=(TENSOR_PARALLEL_DIM,)))
    placed = tensor_splits(live, 2)
    names = {id(p): name for name, p in planned_model.named_parameters()}
    live_names = {id(p): name for name, p in live.named_parameters()}
    assert {names[key]: dim for key, dim in planned.dims.items()} == {
        live_names[key]: dim for key, dim in placed.dims.items()
    }
    layer = "model.base_model.model.model.layers.0.self_attn"
    assert planned.styles[f"{layer}.q_proj.lora_B.default"] == "colwise"  # B's rows are q_proj's output columns
    assert planned.styles[f"{layer}.o_proj.lora_A.default"] == "rowwise"  # A reads o_proj's split input
    assert f"{layer}.q_proj.lora_A.default" not in planned.styles


def test_layers_whose_collectives_are_not_estimated_are_named_in_the_note():
    plan = {"norm": "sequence_parallel", "up": "colwise", "down": "rowwise"}
    model = nn.Sequential()
    model.add_module("norm", nn.LayerNorm(8))
    model.add_module("up", nn.Linear(8, 16))
    model.add_module("down", nn.Linear(16, 8))
    estimate_ = estimate_module(
        model, strategy="fsdp2", world_size=4, tensor_parallel_size=2, tensor_parallel_plan=plan
    )
    assert "collectives of sequence_parallel layers not estimated" in estimate_.note


def traced_gpt(batch_size: int, plan: dict[str, str] | None):
    """``fsdp_strategy.estimate`` of the testkit GPT at 2 x 2, its step traced on ``batch_size`` sequences."""
    return estimate(
        "testkit.tensor_parallel:TensorParallelGPT",
        init_args={"parallelize": "none"},  # configure_model leaves it whole
        world_sizes=[4],
        strategies=["fsdp2"],
        tensor_parallel_size=2,
        tensor_parallel_plan=plan,
        batch_size=batch_size,
        seq_len=SEQ,
    )


def test_the_traced_activation_all_reduce_counts_each_pair_forward_and_backward():
    batch = 3
    report = traced_gpt(batch, plan_styles())
    row = report.rows[0]
    activation = batch * SEQ * GPT().norm.normalized_shape[0] * F32
    # per block: o's and down's outputs in forward; q's, k's, v's and up's input gradients in backward
    assert row.tensor_parallel_all_reduce_bytes == 2 * (2 + 4) * activation
    ring = (row.all_gather_bytes + row.reduce_scatter_bytes) / 2 + 2 * row.tensor_parallel_all_reduce_bytes / 2
    assert row.sent_bytes == round(ring)
    table = report.table()
    assert "1x2x2" in table and "tp all-reduce" in table


def test_without_a_known_split_the_traced_all_reduce_is_not_estimated():
    row = traced_gpt(2, None).rows[0]
    assert row.tensor_parallel_all_reduce_bytes is None and "is not known" in row.note
    assert row.step_peak_bytes is not None  # the step was traced all the same
    split = traced_gpt(2, plan_styles()).rows[0]
    # with the split known the replay counts each rank's part of the gathered units and of the gradients
    assert split.step_peak_bytes < row.step_peak_bytes


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"strategy": "ddp", "world_size": 4, "tensor_parallel_size": 2},
            ValueError,
            "`tensor_parallel_size=2` needs an fsdp2 strategy",
        ),
        (
            {"strategy": "fsdp2", "world_size": 3, "tensor_parallel_size": 2},
            ValueError,
            "tensor_parallel_size=2 must divide the devices per node (3) and the world size (3)",
        ),
        (
            {"strategy": "fsdp2", "world_size": 4, "tensor_parallel_size": 0},
            ValueError,
            "`tensor_parallel_size` must be a positive int; got 0.",
        ),
        (
            {"strategy": "fsdp2", "world_size": 4, "tensor_parallel_size": 2, "tensor_parallel_plan": {"up": "local"}},
            ValueError,
            "`tensor_parallel_plan` splits 'up' as 'local'",
        ),
    ],
)
def test_bad_tensor_parallel_options_name_the_option_and_the_value(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        estimate_module(meta(), **kwargs)


def test_the_cli_takes_tensor_parallel_size_and_skips_ddp(capsys):
    args = ["estimate", "testkit.hf:TinyLlama", "--world-sizes", "4", "--tensor-parallel-size", "2", "--json"]
    assert main([*args, "--strategies", "ddp,fsdp2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["strategy"], r["mesh"], r["tensor_parallel"]) for r in report["rows"]] == [("fsdp2", [1, 2], 2)]
    assert report["rows"][0]["tensor_parallel_all_reduce_bytes"] is None
    assert [s["strategy"] for s in report["skipped"]] == ["ddp"]


def test_a_tensor_parallel_size_that_does_not_fit_a_node_skips_that_row_only():
    report = estimate(
        "testkit.hf:TinyLlama", world_sizes=[4, 8], strategies=["fsdp2"], processes_per_node=2, tensor_parallel_size=4
    )
    assert report.rows == []
    assert {(world, reason) for _, world, reason in report.skipped} == {
        (4, "tensor_parallel_size=4 does not divide processes_per_node=2"),
        (8, "tensor_parallel_size=4 does not divide processes_per_node=2"),
    }
    fits = estimate(
        "testkit.hf:TinyLlama", world_sizes=[8], strategies=["fsdp2"], processes_per_node=4, tensor_parallel_size=4
    )
    assert [(row.mesh, row.tensor_parallel) for row in fits.rows] == [((1, 2), 4)]


def test_the_monitor_summary_names_the_mesh_and_what_it_does_not_estimate():
    row = dict.fromkeys(
        ("peak_rss_bytes", "rss_growth_bytes", "live_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes"),
        math.nan,
    )
    row |= {"model_state_bytes": 2**20, "samples": 8, "tokens": 64, "batches": 2, "seconds": 1.0}
    summary = summarize([{**row, "flops_per_batch": math.nan}] * 4, peak_flops=None)
    figures = dict.fromkeys(("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "sent_bytes"), 2**20)
    table = format_summary(
        {
            **summary,
            **figures,
            "strategy": "fsdp2",
            "mesh": [1, 2, 2],
            "tensor_parallel_all_reduce_bytes": None,
            "estimated_model_state_bytes": 2**20,
            "estimate_note": "",
        }
    )
    assert "fsdp2 plan, mesh 1 replicate x 2 shard x 2 tensor_parallel" in table
    assert "tensor-parallel activation all-reduce not estimated" in table
