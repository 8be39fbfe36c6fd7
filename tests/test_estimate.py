"""The estimator: exact byte counts on hand-countable models, recommendations, sizes, the command."""

from __future__ import annotations

import json
import re

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_strategy.estimator.model_state import Estimate, estimate_module
from fsdp_strategy.estimator.report import estimate, recommend
from fsdp_strategy.estimator.target import load_target
from fsdp_strategy.sharding.mixed_precision import mixed_precision_policy
from fsdp_strategy.sharding.parallelize import apply_fully_shard, plan_units
from fsdp_strategy.sharding.policy import normalize_policy
from fsdp_strategy.sizes import format_bytes
from fsdp_strategy.tools.cli import (
    main,
    parse_init_args,
    parse_strategies,
    parse_world_sizes,
)
from testkit.models import TinyLM

F32 = 4
STRATEGY_NAMES = "ddp, fsdp2, fsdp2_grad_op, fsdp2_hybrid, fsdp2_offload"
SIZE_FORMS = "a size like 80GiB, 80GB, 512MiB or 1.5TiB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), or plain bytes"
HYBRID_NODES = "fsdp2_hybrid shards within a node and replicates across nodes."
WRAP_POLICIES = (
    '"auto", a list of module class names (e.g. ["Block"]), a set of nn.Module classes, a callable'
    " (name, module) -> bool, a positive int (minimum parameters per unit), or None"
)


def raises(exception: type[Exception], message: str):
    return pytest.raises(exception, match=re.escape(message))


class Block(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)  # weight (3, 4), bias (3,): rank 0 holds 2 of 3 rows at 2 ranks
        self.norm = nn.LayerNorm(3) if norm else None  # weight (3,), bias (3,)


class Net(nn.Module):
    """Root: the embedding (7, 4), tied to the head. Two blocks (auto policy: a ModuleList of a repeated class)."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.blocks = nn.ModuleList([Block(norm), Block(norm)])
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight


def meta(cls=Net, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return cls(**kwargs)


# Rank 0's shards at 2 ranks, in elements: the embedding ceil(7/2)=4 rows of 4 = 16; a block's weight
# 2 rows of 4 = 8 and bias 2 = 10 per block. Gathered (padded to 2 shards): the rest of the model (the
# tied embedding and head, one group) 32, a block 20. The root holds nothing.
SHARD_2 = 16 + 10 + 10
REST_FULL, BLOCK_FULL = 32, 20
# The rest of the model is one group kept gathered from forward to backward: one all-gather per micro-batch.
REST_GATHERS = 1


# --- byte counts ----------------------------------------------------------------------------------


def test_fsdp2_counts_padded_shards_and_the_tied_weight_once():
    est = estimate_module(meta(), strategy="fsdp2", world_size=2)
    assert est.mesh == (1, 2)
    assert est.param_bytes == est.grad_bytes == SHARD_2 * F32 == 144
    assert est.optimizer_bytes == 2 * 144 + 5 * 4  # exp_avg, exp_avg_sq, and a step counter per tensor
    assert est.model_state_bytes == 144 + 144 + 308
    assert est.largest_unit_bytes == REST_FULL * F32  # the group of the tied embedding and head is the largest
    # Each block is gathered in forward and again in backward, the rest of the model once.
    assert est.all_gather_bytes == (REST_GATHERS * REST_FULL + 2 * 2 * BLOCK_FULL) * F32 == 448
    assert est.reduce_scatter_bytes == (REST_FULL + 2 * BLOCK_FULL) * F32 == 288
    assert est.all_reduce_bytes == est.host_bytes == 0
    # the rest gathered + two blocks (one prefetched) + the rest's unsharded gradients + a block's gradient
    # and its reduce-scatter input
    assert est.working_bytes == (REST_FULL + 2 * BLOCK_FULL + REST_FULL + 2 * BLOCK_FULL) * F32
    assert est.peak_bytes == est.model_state_bytes + est.working_bytes
    assert est.sent_bytes == (448 + 288) // 2


def test_the_roots_own_parameters_are_gathered_twice_the_groups_once():
    model = meta()
    with torch.device("meta"):
        model.gain = nn.Parameter(torch.ones(6))  # the root's own: gathered by training_step and again in backward
    est = estimate_module(model, strategy="fsdp2", world_size=2)
    assert est.all_gather_bytes == (2 * 6 + REST_GATHERS * REST_FULL + 2 * 2 * BLOCK_FULL) * F32


def test_one_rank_keeps_everything_and_communicates_nothing():
    est = estimate_module(meta(), strategy="fsdp2", world_size=1)
    assert est.param_bytes == (28 + 2 * 15) * F32
    assert est.all_gather_bytes == est.reduce_scatter_bytes == est.sent_bytes == 0  # FSDP2 copies instead


def test_mixed_precision_keeps_fp32_shards_gathers_in_bf16_and_norms_in_fp32():
    est = estimate_module(meta(norm=True), strategy="fsdp2", world_size=2, precision="bf16-mixed")
    norm_shard, norm_full = 2 + 2, 8  # LayerNorm(3): weight and bias, 2 of 3 elements each; gathered 4 each
    assert est.param_bytes == (SHARD_2 + 2 * norm_shard) * F32
    # the rest and the blocks in bf16; both norms in one fp32 group, gathered once like the rest
    per_micro_batch = REST_GATHERS * REST_FULL * 2 + 2 * 2 * BLOCK_FULL * 2 + 2 * norm_full * F32
    assert est.all_gather_bytes == per_micro_batch
    assert est.reduce_scatter_bytes == (REST_FULL + 2 * (BLOCK_FULL + norm_full)) * F32  # reduced in fp32
    assert est.largest_unit_bytes == REST_FULL * 2


def test_true_half_precision_keeps_everything_in_the_low_dtype():
    est = estimate_module(meta(), strategy="fsdp2", world_size=2, precision="bf16-true")
    assert est.param_bytes == est.grad_bytes == SHARD_2 * 2
    assert est.optimizer_bytes == 2 * SHARD_2 * 2 + 5 * 4
    assert est.all_gather_bytes == 448 // 2


def test_double_precision_keeps_everything_in_float64():
    single = estimate_module(meta(), strategy="fsdp2", world_size=2)
    double = estimate_module(meta(), strategy="fsdp2", world_size=2, precision="64-true")
    assert double.param_bytes == double.grad_bytes == SHARD_2 * 8
    assert double.all_gather_bytes == 2 * single.all_gather_bytes
    assert double.reduce_scatter_bytes == 2 * single.reduce_scatter_bytes


def test_optimizers_and_frozen_parameters():
    assert estimate_module(meta(), strategy="fsdp2", world_size=2, optimizer="sgd").optimizer_bytes == 0
    assert estimate_module(meta(), strategy="fsdp2", world_size=2, optimizer="sgd_momentum").optimizer_bytes == 144
    model = meta()
    model.embed.requires_grad_(False)
    est = estimate_module(model, strategy="fsdp2", world_size=2)
    assert est.param_bytes == 144
    assert est.grad_bytes == 20 * F32
    assert est.optimizer_bytes == 2 * 80 + 4 * 4
    assert est.reduce_scatter_bytes == 2 * BLOCK_FULL * F32


def test_grad_op_gathers_once_per_micro_batch_and_reduces_once_per_step():
    est = estimate_module(meta(), strategy="fsdp2_grad_op", world_size=2, accumulate_grad_batches=2)
    assert est.all_gather_bytes == 2 * (REST_GATHERS * REST_FULL + 2 * BLOCK_FULL) * F32
    assert est.reduce_scatter_bytes == 288
    # every unit stays gathered; accumulation keeps every unsharded gradient in the reduce dtype
    gathered, root_grads, block_grad_and_input, accumulated = 288, 128, 160, 288
    assert est.working_bytes == gathered + root_grads + block_grad_and_input + accumulated
    fsdp2 = estimate_module(meta(), strategy="fsdp2", world_size=2, accumulate_grad_batches=2)
    assert fsdp2.all_gather_bytes == 2 * 448


def test_hybrid_shards_within_a_node_and_all_reduces_the_shard():
    est = estimate_module(meta(), strategy="fsdp2_hybrid", world_size=4, processes_per_node=2)
    assert est.mesh == (2, 2)
    assert est.note == ""
    assert est.param_bytes == 144  # sharded over 2, as fsdp2 at 2 ranks
    assert est.all_reduce_bytes == 144  # the fp32 gradient shard across the 2 replicas
    assert (est.all_gather_bytes, est.reduce_scatter_bytes) == (448, 288)
    assert est.sent_bytes == (448 + 288) // 2 + 144


def test_hybrid_with_sharded_accumulation_reduce_scatters_each_micro_batch_and_all_reduces_once():
    options = {"strategy": "fsdp2_hybrid", "world_size": 4, "processes_per_node": 2, "accumulate_grad_batches": 4}
    unsharded = estimate_module(meta(), **options)
    sharded = estimate_module(meta(), **options, sync_grads_each_micro_batch=True)
    assert unsharded.reduce_scatter_bytes == 288 and sharded.reduce_scatter_bytes == 4 * 288
    assert sharded.all_reduce_bytes == unsharded.all_reduce_bytes == 144  # the partial sum, all-reduced once
    assert sharded.all_gather_bytes == unsharded.all_gather_bytes
    # between micro-batches: every unsharded gradient (288) or every unit's partial sum of shards (144)
    assert unsharded.working_bytes - sharded.working_bytes == 288 - 144
    one_dimensional = {**options, "strategy": "fsdp2", "processes_per_node": None}
    # without replicas the shards accumulate in the gradients, which the model state counts already
    assert (
        estimate_module(meta(), **one_dimensional).working_bytes
        - estimate_module(meta(), **one_dimensional, sync_grads_each_micro_batch=True).working_bytes
    ) == estimate_module(meta(), **one_dimensional).reduce_scatter_bytes
    with pytest.raises(TypeError, match="`sync_grads_each_micro_batch` must be a bool; got 'yes' of type str."):
        estimate_module(meta(), **options, sync_grads_each_micro_batch="yes")


def test_hybrid_without_processes_per_node_assumes_two_nodes():
    est = estimate_module(meta(), strategy="fsdp2_hybrid", world_size=4)
    assert est.mesh == (2, 2)
    assert est.note == "assumes 2 nodes of 2 processes (set processes_per_node)"
    odd = estimate_module(meta(), strategy="fsdp2_hybrid", world_size=3)
    assert odd.mesh == (1, 3)
    assert odd.note == "one node assumed (world size 3 is odd): same as fsdp2"


def test_offload_keeps_the_sharded_state_on_the_host():
    fsdp2 = estimate_module(meta(), strategy="fsdp2", world_size=2)
    est = estimate_module(meta(), strategy="fsdp2_offload", world_size=2)
    assert est.param_bytes == est.grad_bytes == est.optimizer_bytes == est.model_state_bytes == 0
    assert est.host_bytes == fsdp2.model_state_bytes
    assert est.peak_bytes == fsdp2.working_bytes
    assert (est.all_gather_bytes, est.reduce_scatter_bytes) == (fsdp2.all_gather_bytes, fsdp2.reduce_scatter_bytes)


def test_ddp_replicates_all_reduces_gradients_and_counts_its_buckets():
    full = (28 + 2 * 15) * F32
    est = estimate_module(meta(), strategy="ddp", world_size=2, accumulate_grad_batches=4)
    assert est.mesh == (2, 1)
    assert est.param_bytes == est.grad_bytes == full
    assert est.optimizer_bytes == 2 * full + 5 * 4
    assert est.all_reduce_bytes == full  # once per step: no_sync on the other micro-batches
    assert est.all_gather_bytes == est.reduce_scatter_bytes == est.largest_unit_bytes == 0
    assert est.working_bytes == full  # the gradient buckets
    mixed = estimate_module(meta(), strategy="ddp", world_size=2, precision="bf16-mixed")
    assert mixed.working_bytes == full + (28 + 2 * 12) * 2  # + autocast's bf16 copies of the weight matrices
    assert estimate_module(meta(), strategy="ddp", world_size=1).all_reduce_bytes == 0


def test_an_explicit_wrap_policy_and_none():
    one_unit = estimate_module(meta(), strategy="fsdp2", world_size=2, wrap_policy=None)
    assert one_unit.largest_unit_bytes == (REST_FULL + 2 * BLOCK_FULL) * F32
    # one group of everything below the root, gathered once
    assert one_unit.all_gather_bytes == (REST_FULL + 2 * BLOCK_FULL) * F32
    by_name = estimate_module(meta(), strategy="fsdp2", world_size=2, wrap_policy=["Block"])
    assert by_name == estimate_module(meta(), strategy="fsdp2", world_size=2)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_live_sharded_model_gives_the_estimate_of_its_meta_twin(mesh, precision):
    """The monitor estimates the training model: DTensor parameters count with their global shapes,
    and its units are the ones it was sharded with."""
    live = TinyLM()
    mixed = mixed_precision_policy(precision)
    mp_policy = mixed or MixedPrecisionPolicy()
    auto = normalize_policy("auto", option="wrap_policy")
    units = plan_units(live, auto, mp_policy=mp_policy, keep_norms_fp32=mixed is not None)
    apply_fully_shard(
        live, units, mesh, root_mp_policy=mp_policy, offload_policy=OffloadPolicy(), reshard_after_forward=True
    )
    for strategy in ("fsdp2", "fsdp2_grad_op", "ddp"):
        expected = estimate_module(meta(TinyLM), strategy=strategy, world_size=2, precision=precision)
        assert estimate_module(live, strategy=strategy, world_size=2, precision=precision) == expected


def test_a_ten_billion_parameter_model_is_estimated_without_memory():
    class Huge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8192, 8192) for _ in range(150))  # 10.07e9 parameters

    report = estimate(Huge, world_sizes=[8, 64], strategies=["fsdp2"], budget="80GiB")
    assert report.num_params == 150 * (8192 * 8192 + 8192)
    assert report.rows[0].param_bytes == report.num_params * 4 // 8  # 8192 rows divide evenly
    assert report.recommendation(8).strategy == "fsdp2"


def test_configure_model_runs_on_the_meta_device_too():
    class Late(L.LightningModule):
        def __init__(self, width: int = 4) -> None:
            super().__init__()
            self.width = width
            self.layer: nn.Module | None = None

        def configure_model(self) -> None:
            self.layer = nn.Linear(self.width, self.width)

    report = estimate(Late, init_args={"width": 6}, world_sizes=[1], strategies=["ddp"])
    assert report.num_params == 42
    assert report.model == "Late"


# --- option errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "zero3"}, f"`strategy` must be one of {STRATEGY_NAMES}; got 'zero3'."),
        ({"world_size": 0}, "`world_size` must be a positive int; got 0."),
        ({"optimizer": "lamb"}, "`optimizer` must be one of adamw, adam, sgd, sgd_momentum, none; got 'lamb'."),
        (
            {"precision": "transformer-engine"},
            "`precision` must be one of 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true (or Lightning's"
            " aliases 32, 16, bf16); got 'transformer-engine'.",
        ),
        ({"accumulate_grad_batches": 0}, "`accumulate_grad_batches` must be a positive int; got 0."),
        ({"processes_per_node": -2}, "`processes_per_node` must be a positive int; got -2."),
        (
            {"strategy": "fsdp2_hybrid", "world_size": 4, "processes_per_node": 3},
            f"`processes_per_node=3` must divide the world size 4: {HYBRID_NODES}",
        ),
    ],
)
def test_bad_options_name_the_option_and_the_value(kwargs, message):
    options = {"strategy": "fsdp2", "world_size": 2, **kwargs}
    with raises(ValueError, message):
        estimate_module(meta(), **options)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": True}, "`world_size` must be a positive int; got True of type bool."),
        ({"world_size": 2.0}, "`world_size` must be a positive int; got 2.0 of type float."),
        ({"accumulate_grad_batches": "2"}, "`accumulate_grad_batches` must be a positive int; got '2' of type str."),
        ({"processes_per_node": 1.5}, "`processes_per_node` must be a positive int; got 1.5 of type float."),
    ],
)
def test_counts_of_the_wrong_type_are_type_errors(kwargs, message):
    # The same check as FSDP2Strategy's and ShardingMonitor's options: a wrong type is a TypeError.
    options = {"strategy": "fsdp2", "world_size": 2, **kwargs}
    with raises(TypeError, message):
        estimate_module(meta(), **options)


def test_lightning_precision_aliases_are_accepted():
    assert estimate_module(meta(), strategy="fsdp2", world_size=2, precision="bf16").precision == "bf16-mixed"


def test_module_must_be_a_module():
    with pytest.raises(TypeError, match=re.escape("`module` must be a torch.nn.Module; got str.")):
        estimate_module("Net", strategy="fsdp2", world_size=2)


def test_cli_list_and_json_parsers():
    assert parse_world_sizes("1,2,8") == [1, 2, 8]
    assert parse_strategies("ddp,fsdp2") == ["ddp", "fsdp2"]
    assert parse_init_args('{"n_layer": 2}') == {"n_layer": 2}
    assert parse_init_args(None) == {}
    for text in ("2,x", "0"):
        with raises(
            ValueError, f"`--world-sizes` must be comma-separated positive ints such as 1,2,4,8; got {text!r}."
        ):
            parse_world_sizes(text)
    with raises(ValueError, f"`--strategies` must be comma-separated names from {STRATEGY_NAMES}; got 'ddp,zero'."):
        parse_strategies("ddp,zero")
    with raises(ValueError, """`--init-args` must be a JSON object such as '{"n_layer": 12}'; got '[2]'."""):
        parse_init_args("[2]")


# --- loading the model ---------------------------------------------------------------------------------


def test_load_target_errors():
    with raises(
        ValueError,
        "The model must be given as 'MODULE:Class' (for example 'examples.gpt:GPT') or a class; got 'testkit.models'.",
    ):
        load_target("testkit.models")
    with raises(
        ValueError,
        "Could not import 'integration_tests.nowhere' for 'integration_tests.nowhere:X': No module named"
        " 'integration_tests.nowhere'. MODULE must be importable from the current directory or the Python path.",
    ):
        load_target("integration_tests.nowhere:X")
    with raises(
        ValueError,
        "'testkit.models' has no attribute 'Tiny'; its nn.Module classes are: Block, LightningModule,"
        " MulticlassAccuracy, PoisonedLM, TinyGAN, TinyLM.",
    ):
        load_target("testkit.models:Tiny")
    with raises(TypeError, "'testkit.models:token_loader' must name a torch.nn.Module subclass; it is <function"):
        load_target("testkit.models:token_loader")


def test_bad_init_args_name_the_call():
    with raises(
        ValueError, "Could not build TinyLM(depth=3): TinyLM.__init__() got an unexpected keyword argument 'depth'"
    ):
        estimate("testkit.models:TinyLM", init_args={"depth": 3}, world_sizes=[1])


def test_estimate_option_errors():
    with raises(ValueError, "`world_sizes` must be a non-empty list of positive ints; got []."):
        estimate(Net, world_sizes=[])
    with raises(ValueError, f"`strategies` must be a non-empty list from {STRATEGY_NAMES}; got ['fsdp']."):
        estimate(Net, world_sizes=[2], strategies=["fsdp"])
    with raises(ValueError, f"`budget` must be {SIZE_FORMS}; got 'lots'."):
        estimate(Net, world_sizes=[2], budget="lots")


# --- recommendations -----------------------------------------------------------------------------------


def row(strategy: str, peak: int, world_size: int = 2) -> Estimate:
    return Estimate(strategy, world_size, (1, world_size), peak, 0, 0, 0, 0, 0, 0, 0)


ROWS = [row("ddp", 9 * 2**30), row("fsdp2", 4 * 2**30), row("fsdp2_grad_op", 6 * 2**30), row("fsdp2_offload", 2**30)]


def test_recommends_the_simplest_strategy_that_fits():
    assert recommend(ROWS, 2, 10 * 2**30).strategy == "ddp"
    reason = recommend(ROWS, 2, 10 * 2**30).reason
    assert reason == "ddp needs 9.0 GiB per rank <= 10.0 GiB budget, and it is the simplest"
    fits_grad_op = recommend(ROWS, 2, 8 * 2**30)
    assert fits_grad_op.strategy == "fsdp2_grad_op"  # simpler than fsdp2, although fsdp2 needs less
    assert fits_grad_op.reason == (
        "ddp needs 9.0 GiB per rank > 8.0 GiB budget; fsdp2_grad_op needs 6.0 GiB per rank <= 8.0 GiB budget"
    )
    offload = recommend(ROWS, 2, 2 * 2**30)
    assert offload.strategy == "fsdp2_offload"
    assert offload.reason == (
        "ddp 9.0 GiB, fsdp2_grad_op 6.0 GiB, fsdp2 4.0 GiB per rank exceed the 2.0 GiB budget;"
        " fsdp2_offload needs 1.0 GiB per rank <= 2.0 GiB budget"
    )


def test_no_strategy_fits():
    rec = recommend(ROWS, 2, 2**29)
    assert rec.strategy is None
    assert rec.reason == (
        "nothing fits the 512.0 MiB budget per rank (ddp 9.0 GiB, fsdp2_grad_op 6.0 GiB, fsdp2 4.0 GiB,"
        " fsdp2_offload 1.0 GiB); use more ranks, a lower precision or a lighter optimizer"
    )


def test_report_recommends_per_world_size_and_only_with_a_budget():
    report = estimate(Net, world_sizes=[1, 2], budget=600)
    assert [(r.world_size, r.strategy) for r in report.recommendations] == [(1, "fsdp2_offload"), (2, "fsdp2_offload")]
    assert report.recommendation(4) is None
    assert estimate(Net, world_sizes=[2]).recommendations == []


def test_hybrid_rows_that_do_not_fit_the_node_size_are_skipped_with_the_reason():
    report = estimate(Net, world_sizes=[2, 3], strategies=["fsdp2_hybrid"], processes_per_node=2)
    assert [(r.world_size, r.mesh) for r in report.rows] == [(2, (1, 2))]
    assert report.skipped == [
        ("fsdp2_hybrid", 3, f"`processes_per_node=2` must divide the world size 3: {HYBRID_NODES}")
    ]
    # World size 3 has no rows at all, yet the table names it and why it was skipped.
    lines = report.table().splitlines()
    assert lines[lines.index("world size 3") + 1] == (
        f"  fsdp2_hybrid: skipped: `processes_per_node=2` must divide the world size 3: {HYBRID_NODES}"
    )


def test_hybrid_with_a_node_size_still_rejects_bad_options():
    with raises(ValueError, "`optimizer` must be one of adamw, adam, sgd, sgd_momentum, none; got 'lion'."):
        estimate(Net, world_sizes=[2, 3], strategies=["fsdp2_hybrid"], processes_per_node=2, optimizer="lion")
    with raises(ValueError, f"`wrap_policy` must be {WRAP_POLICIES}; got the empty string."):
        estimate(Net, world_sizes=[3], strategies=["fsdp2_hybrid"], processes_per_node=2, wrap_policy="")
    with raises(ValueError, "`processes_per_node` must be a positive int; got 0."):
        estimate(Net, world_sizes=[2], strategies=["fsdp2_hybrid"], processes_per_node=0)


# --- the command ---------------------------------------------------------------------------------------


def test_command_prints_a_table_and_a_recommendation(capsys):
    argv = ["estimate", "testkit.models:TinyLM", "--world-sizes", "1,2", "--budget", "100KiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    tiny = [estimate_module(meta(TinyLM), strategy=s, world_size=2) for s in ("ddp", "fsdp2_grad_op")]
    assert out.splitlines()[0] == "TinyLM: 5,456 parameters, precision 32-true, optimizer adamw"
    assert "world size 2" in out.splitlines()
    header = next(line for line in out.splitlines() if line.startswith("strategy"))
    assert header.split() == (
        "strategy mesh params grads optimizer largest unit peak* all-gather reduce-scatter all-reduce host".split()
    )
    fsdp2_line = next(line for line in out.splitlines() if line.startswith("fsdp2 ") and " 1x2 " in line)
    assert fsdp2_line.split()[:4] == ["fsdp2", "1x2", "10.7", "KiB"]
    assert (
        f"world size 2: fsdp2_grad_op (ddp needs {format_bytes(tiny[0].peak_bytes)} per rank > 100.0 KiB budget;"
        f" fsdp2_grad_op needs {format_bytes(tiny[1].peak_bytes)} per rank <= 100.0 KiB budget)"
    ) in out


def test_command_json(capsys):
    argv = ["estimate", "testkit.models:TinyLM", "--world-sizes", "2", "--strategies", "fsdp2"]
    argv += ["--precision", "bf16-mixed", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    expected = estimate_module(meta(TinyLM), strategy="fsdp2", world_size=2, precision="bf16-mixed")
    assert report["rows"] == [expected.as_dict()]
    assert report["budget"] is None and report["recommendations"] == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "80 gigs"], f"`--budget` must be {SIZE_FORMS}; got '80 gigs'.\n"),
        (
            ["--world-sizes", "two"],
            "`--world-sizes` must be comma-separated positive ints such as 1,2,4,8; got 'two'.\n",
        ),
        (["--init-args", "{"], """`--init-args` must be a JSON object such as '{"n_layer": 12}'; got '{' (Expecting"""),
    ],
)
def test_command_user_errors_exit_with_2(capsys, argv, message):
    assert main(["estimate", "testkit.models:TinyLM", *argv]) == 2
    assert capsys.readouterr().err.startswith("fsdp-strategy estimate: error: " + message)


def test_command_import_error_exits_with_2(capsys):
    assert main(["estimate", "no_such_package.models:Model"]) == 2
    assert capsys.readouterr().err == (
        "fsdp-strategy estimate: error: Could not import 'no_such_package.models' for 'no_such_package.models:Model':"
        " No module named 'no_such_package'. MODULE must be importable from the current directory or the Python path.\n"
    )


def test_command_accepts_lightnings_precision_aliases(capsys):
    argv = ["estimate", "testkit.models:TinyLM", "--world-sizes", "2", "--strategies", "fsdp2"]
    assert main([*argv, "--precision", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16-mixed"


def test_command_rejects_an_unknown_precision(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "testkit.models:TinyLM", "--precision", "fp8"])
    assert exit_info.value.code == 2
    assert "argument --precision: invalid choice: 'fp8'" in capsys.readouterr().err
