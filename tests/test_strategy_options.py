"""``FSDP2Strategy`` options: validation messages, registered names, properties, and what a Trainer
constructor (no fit, no process started) makes of them."""

from __future__ import annotations

import re
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_strategy  # noqa: F401  (importing it registers the strategy names)
from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.plugins.precision import (
    FSDP2DoublePrecision,
    FSDP2HalfPrecision,
    FSDP2MixedPrecision,
    FSDP2Precision,
)
from fsdp_strategy.strategy import ShardingPlan
from testkit.models import Block

ACCEPTED_POLICIES = (
    '"auto", a list of module class names (e.g. ["Block"]), a set of nn.Module classes, a callable'
    " (name, module) -> bool, a positive int (minimum parameters per unit), or None"
)
OFFLOAD_NEEDS_CUDA = (
    "`cpu_offload=True` (strategy 'fsdp2_offload') needs CUDA: it moves sharded state between"
    " GPU and host memory, and no CUDA device is available here. Use `cpu_offload=False`."
)
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")


def cpu_trainer(**kwargs) -> L.Trainer:
    """A Trainer that is only constructed: no fit, so no process or process group is started."""
    kwargs.setdefault("accelerator", "cpu")
    return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


# --- constructor: bad values, exact messages --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"replicate_size": 0}, ValueError, "`replicate_size` must be a positive int or None; got 0."),
        ({"replicate_size": -1}, ValueError, "`replicate_size` must be a positive int or None; got -1."),
        ({"shard_size": 0}, ValueError, "`shard_size` must be a positive int or None; got 0."),
        ({"shard_size": -4}, ValueError, "`shard_size` must be a positive int or None; got -4."),
        (
            {"shard_size": 2.0},
            TypeError,
            "`shard_size` must be a positive int or None; got 2.0 of type float.",
        ),
        (
            {"replicate_size": True},
            TypeError,
            "`replicate_size` must be a positive int or None; got True of type bool.",
        ),
        (
            {"reshard_after_forward": 0},
            ValueError,
            "`reshard_after_forward` must be a bool or a positive int; got 0.",
        ),
        (
            {"reshard_after_forward": -2},
            ValueError,
            "`reshard_after_forward` must be a bool or a positive int; got -2.",
        ),
        (
            {"reshard_after_forward": "yes"},
            TypeError,
            "`reshard_after_forward` must be a bool or a positive int; got 'yes' of type str.",
        ),
        ({"timeout": 0}, ValueError, "`timeout` must be a positive, finite number of seconds; got 0.0."),
        ({"timeout": -5}, ValueError, "`timeout` must be a positive, finite number of seconds; got -5.0."),
        ({"timeout": timedelta(0)}, ValueError, "`timeout` must be a positive, finite number of seconds; got 0.0."),
        ({"timeout": float("nan")}, ValueError, "`timeout` must be a positive, finite number of seconds; got nan."),
        ({"timeout": float("inf")}, ValueError, "`timeout` must be a positive, finite number of seconds; got inf."),
        (
            {"timeout": "10"},
            TypeError,
            "`timeout` must be a number of seconds or a datetime.timedelta; got '10' of type str.",
        ),
        (
            {"timeout": True},
            TypeError,
            "`timeout` must be a number of seconds or a datetime.timedelta; got True of type bool.",
        ),
        ({"hybrid": "yes"}, TypeError, "`hybrid` must be a bool; got 'yes' of type str."),
        ({"meta_init": 1}, TypeError, "`meta_init` must be a bool; got 1 of type int."),
        ({"reuse_comm_buffers": "no"}, TypeError, "`reuse_comm_buffers` must be a bool; got 'no' of type str."),
        ({"hook_view": "full"}, ValueError, "`hook_view` must be one of ('whole', 'sharded'); got 'full'."),
        ({"hook_view": 1}, TypeError, "`hook_view` must be a str, one of ('whole', 'sharded'); got 1 of type int."),
        (
            {"compile_blocks": None},
            TypeError,
            "`compile_blocks` must be a bool or the name of a torch.compile backend; got None of type NoneType.",
        ),
        (
            {"compile_blocks": ""},
            ValueError,
            "`compile_blocks` must be a bool or the name of a torch.compile backend; got ''.",
        ),
        (
            {"sync_grads_each_micro_batch": "false"},
            TypeError,
            "`sync_grads_each_micro_batch` must be a bool; got 'false' of type str.",
        ),
        ({"cpu_offload": 0}, TypeError, "`cpu_offload` must be a bool; got 0 of type int."),
        (
            {"mp_policy": "bf16"},
            TypeError,
            "`mp_policy` must be a torch.distributed.fsdp.MixedPrecisionPolicy or None; got 'bf16' of type str.",
        ),
        (
            {"state_dict_type": "zip"},
            ValueError,
            "`state_dict_type` must be one of ('auto', 'sharded', 'full', 'adapter'); got 'zip'.",
        ),
        (
            {"state_dict_type": 5},
            TypeError,
            "`state_dict_type` must be a str, one of ('auto', 'sharded', 'full', 'adapter'); got 5 of type int.",
        ),
        (
            {"process_group_backend": 5},
            TypeError,
            "`process_group_backend` must be a str such as 'nccl' or 'gloo', or None; got 5 of type int.",
        ),
        ({"wrap_policy": 3.5}, TypeError, f"`wrap_policy` must be {ACCEPTED_POLICIES}; got 3.5 of type float."),
        ({"wrap_policy": True}, TypeError, f"`wrap_policy` must be {ACCEPTED_POLICIES}; got the bool True."),
        (
            {"wrap_policy": 0},
            ValueError,
            "`wrap_policy` as a minimum parameter count must be a positive int; got 0.",
        ),
        (
            {"wrap_policy": -5},
            ValueError,
            "`wrap_policy` as a minimum parameter count must be a positive int; got -5.",
        ),
        (
            {"wrap_policy": [Block, 3]},
            TypeError,
            "`wrap_policy` entries must be class names (str) or nn.Module subclasses; got 3 of type int.",
        ),
        (
            {"wrap_policy": []},
            ValueError,
            "`wrap_policy` must name at least one module class; got an empty list.",
        ),
        (
            {"activation_checkpointing_policy": False},
            TypeError,
            f"`activation_checkpointing_policy` must be {ACCEPTED_POLICIES}; got the bool False.",
        ),
        (
            {"activation_checkpointing_policy": ""},
            ValueError,
            f"`activation_checkpointing_policy` must be {ACCEPTED_POLICIES}; got the empty string.",
        ),
    ],
)
def test_invalid_option_is_rejected_with_its_exact_message(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        FSDP2Strategy(**kwargs)


@needs_no_cuda
def test_cpu_offload_without_cuda_is_rejected():
    with pytest.raises(ValueError, match=re.escape(OFFLOAD_NEEDS_CUDA)):
        FSDP2Strategy(cpu_offload=True)


@needs_no_cuda
def test_offload_strategy_name_without_cuda_is_rejected_at_trainer_construction():
    with pytest.raises(ValueError, match=re.escape(OFFLOAD_NEEDS_CUDA)):
        cpu_trainer(strategy="fsdp2_offload")


# --- constructor: accepted values -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [(10, timedelta(seconds=10)), (2.5, timedelta(seconds=2.5)), (timedelta(minutes=1), timedelta(seconds=60))],
)
def test_timeout_accepts_seconds_or_timedelta(timeout, expected):
    assert FSDP2Strategy(timeout=timeout).options.timeout == expected


@pytest.mark.parametrize("value", [True, False, 8])
def test_reshard_after_forward_accepts_bool_or_positive_int(value):
    assert FSDP2Strategy(reshard_after_forward=value).options.reshard_after_forward == value


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("trim", ValueError, "`host_memory` must be one of ('keep', 'release'); got 'trim'."),
        (True, TypeError, "`host_memory` must be a str, one of ('keep', 'release'); got True of type bool."),
    ],
)
def test_host_memory_accepts_keep_or_release(value, error, message):
    # Off by default: it lowers the peak but does not reach the memory targets of issue 11 (docs/benchmarks.md).
    assert FSDP2Strategy().options.host_memory == "keep"
    assert FSDP2Strategy(host_memory="release").options.host_memory == "release"
    with pytest.raises(error, match=re.escape(message)):
        FSDP2Strategy(host_memory=value)


def test_process_group_backend_is_exposed():
    assert FSDP2Strategy(process_group_backend="gloo").process_group_backend == "gloo"
    assert FSDP2Strategy().process_group_backend is None


# --- registry and properties ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "plan"),
    [
        ("fsdp2", ShardingPlan(mesh_shape=(1, 4), reshard_after_forward=True, cpu_offload=False)),
        ("fsdp2_grad_op", ShardingPlan(mesh_shape=(1, 4), reshard_after_forward=False, cpu_offload=False)),
        ("fsdp2_hybrid", ShardingPlan(mesh_shape=(2, 2), reshard_after_forward=True, cpu_offload=False)),
        # A tensor-parallel group per node: the 2 nodes are the data-parallel ranks.
        (
            "fsdp2_tp",
            ShardingPlan(mesh_shape=(1, 2), reshard_after_forward=True, cpu_offload=False, tensor_parallel_size=2),
        ),
        (
            "fsdp2_find_unused_parameters_true",
            ShardingPlan(mesh_shape=(1, 4), reshard_after_forward=True, cpu_offload=False),
        ),
    ],
)
def test_each_registered_name_builds_the_strategy_it_promises(name, plan):
    # Importing the package registered the name: a Trainer of 2 nodes x 2 devices builds an FSDP2Strategy with it.
    strategy = cpu_trainer(strategy=name, devices=2, num_nodes=2).strategy
    assert type(strategy) is FSDP2Strategy, name
    assert strategy.sharding_plan() == plan
    assert StrategyRegistry[name]["description"]


def test_the_offload_name_asks_for_offloading_which_needs_cuda():
    message = "`cpu_offload=True` (strategy 'fsdp2_offload') needs CUDA"
    with pytest.raises(ValueError, match=re.escape(message)):
        cpu_trainer(strategy="fsdp2_offload", devices=1)


def test_grad_op_name_builds_a_strategy_that_keeps_parameters_gathered():
    strategy = cpu_trainer(strategy="fsdp2_grad_op", devices=1).strategy
    assert isinstance(strategy, FSDP2Strategy)
    assert strategy.options.reshard_after_forward is False


def test_hybrid_name_shards_within_a_node_and_replicates_across_nodes():
    hybrid = cpu_trainer(strategy="fsdp2_hybrid", devices=2, num_nodes=2).strategy
    full = cpu_trainer(strategy="fsdp2", devices=2, num_nodes=2).strategy
    assert hybrid.mesh_shape() == (2, 2)
    assert full.mesh_shape() == (1, 4)
    assert not dist.is_initialized()


def test_replicate_size_above_one_implies_hybrid_and_derives_the_shard_size():
    strategy = cpu_trainer(strategy=FSDP2Strategy(replicate_size=2), devices=2, num_nodes=2).strategy
    assert strategy.mesh_shape() == (2, 2)


def test_sharding_plan_tells_the_mesh_resharding_and_offloading(monkeypatch):
    hybrid = cpu_trainer(strategy="fsdp2_hybrid", devices=2, num_nodes=2).strategy
    assert hybrid.sharding_plan() == ShardingPlan(mesh_shape=(2, 2), reshard_after_forward=True, cpu_offload=False)
    grad_op = cpu_trainer(strategy="fsdp2_grad_op", devices=2).strategy
    assert grad_op.sharding_plan() == ShardingPlan(mesh_shape=(1, 2), reshard_after_forward=False, cpu_offload=False)
    to_node = cpu_trainer(strategy=FSDP2Strategy(reshard_after_forward=2), devices=2, num_nodes=2).strategy
    assert to_node.sharding_plan() == ShardingPlan(mesh_shape=(1, 4), reshard_after_forward=2, cpu_offload=False)
    # 2 data x 2 tensor: the mesh shape counts data-parallel ranks, and the plan carries the tensor-parallel size
    tensor = cpu_trainer(strategy=FSDP2Strategy(tensor_parallel_size=2), devices=4).strategy
    assert tensor.sharding_plan() == ShardingPlan(
        mesh_shape=(1, 2), reshard_after_forward=True, cpu_offload=False, tensor_parallel_size=2
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only the constructor asks
    offload = FSDP2Strategy(cpu_offload=True)
    offload.parallel_devices = [torch.device("cpu")] * 2
    assert offload.sharding_plan() == ShardingPlan(mesh_shape=(1, 2), reshard_after_forward=True, cpu_offload=True)


def test_distributed_sampler_counts_every_rank_on_every_node():
    strategy = cpu_trainer(strategy="fsdp2", devices=2, num_nodes=3).strategy
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 6, "rank": 0}


def test_strategy_is_always_distributed():
    assert FSDP2Strategy().is_distributed is True  # DistributedSampler and sync_dist even on one device


def test_device_mesh_before_setup_explains_when_it_exists():
    message = (
        "FSDP2Strategy.device_mesh is available from `setup_environment()` on, e.g. in"
        " `LightningModule.configure_model()`, not before the processes have started."
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        _ = FSDP2Strategy().device_mesh


def test_sharded_save_checkpoint_rejects_storage_options_and_names_the_fix():
    message = (
        "FSDP2Strategy.save_checkpoint does not take `storage_options` for sharded checkpoints; got {'bucket': 'x'}."
        ' They are meant for a CheckpointIO plugin, which writes single files: pass `state_dict_type="full"`.'
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        FSDP2Strategy(state_dict_type="sharded").save_checkpoint({}, "unused.ckpt", storage_options={"bucket": "x"})


# --- precision through the Trainer ------------------------------------------------------------------


def test_default_precision_plugin_is_full_precision():
    strategy = FSDP2Strategy()
    assert type(strategy.precision_plugin) is FSDP2Precision
    assert strategy.mp_policy() == MixedPrecisionPolicy()


@pytest.mark.parametrize(
    ("precision", "plugin_type", "param_dtype"),
    [
        ("32-true", FSDP2Precision, None),
        ("bf16-mixed", FSDP2MixedPrecision, torch.bfloat16),
        ("bf16-true", FSDP2HalfPrecision, None),
        ("64-true", FSDP2DoublePrecision, None),
        ("64", FSDP2DoublePrecision, None),
    ],
)
def test_trainer_precision_becomes_the_strategy_plugin_and_policy(precision, plugin_type, param_dtype):
    trainer = cpu_trainer(strategy="fsdp2", devices=1, precision=precision)
    assert type(trainer.strategy.precision_plugin) is plugin_type
    assert trainer.precision_plugin is trainer.strategy.precision_plugin
    assert trainer.strategy.mp_policy().param_dtype == param_dtype


def test_custom_precision_plugin_is_rejected_and_named():
    class MyPrecision(Precision):
        precision = "32-true"

    message = (
        "FSDP2Strategy does not take custom precision plugins; got MyPrecision. Use `Trainer(precision=...)`"
        " with one of: 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true, or pass `mp_policy=` to the strategy."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        cpu_trainer(strategy="fsdp2", plugins=[MyPrecision()])


def test_explicit_mp_policy_with_mixed_precision_is_a_conflict():
    message = (
        "Conflicting precision settings: `mp_policy` was given to FSDP2Strategy and"
        " `Trainer(precision='bf16-mixed')` too. Pass one of them: keep `mp_policy` with"
        " precision='32-true', or drop `mp_policy`."
    )
    strategy = FSDP2Strategy(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=re.escape(message)):
        cpu_trainer(strategy=strategy, precision="bf16-mixed")


def test_explicit_mp_policy_with_32_true_is_used_as_given():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    trainer = cpu_trainer(strategy=FSDP2Strategy(mp_policy=policy), precision="32-true")
    assert trainer.strategy.mp_policy() is policy


# --- the mesh is checked before any process starts --------------------------------------------------


def test_mesh_that_does_not_fit_the_world_fails_at_trainer_construction():
    message = (
        "The device mesh does not fit the world: replicate_size=3 does not divide the world size 2"
        " (num_nodes x devices). Choose a divisor of 2, or leave it unset."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        cpu_trainer(strategy=FSDP2Strategy(replicate_size=3), devices=2)
    assert not dist.is_initialized()


def test_shard_size_that_does_not_fit_fails_at_trainer_construction():
    message = (
        "The device mesh does not fit the world: replicate_size=1 x shard_size=4 must equal the world size 2"
        " (num_nodes x devices). Choose sizes whose product is 2, or leave one of them unset."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        cpu_trainer(strategy=FSDP2Strategy(replicate_size=1, shard_size=4), devices=2)
