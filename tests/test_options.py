"""The options module on its own: what ``check_options`` derives from plain values. Each refusal's exact message
is tested through ``FSDP2Strategy`` in test_strategy_options.py."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed.fsdp import OffloadPolicy

from fsdp_strategy.options import STATE_DICT_TYPES, Options, check_options
from fsdp_strategy.strategy import FSDP2Strategy

DEFAULTS = dict(
    wrap_policy="auto", activation_checkpointing_policy=None, reshard_after_forward=True, hybrid=False,
    replicate_size=None, shard_size=None, cpu_offload=False, mp_policy=None, sync_grads_each_micro_batch=False,
    compile_blocks=False, meta_init=False, state_dict_type="auto", async_save=False, init_weights=None,
    process_group_backend=None, timeout=1800,
)  # fmt: skip


def test_plain_values_become_the_forms_the_strategy_uses(tmp_path):
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"x")
    options = check_options(**{**DEFAULTS, "replicate_size": 2, "timeout": 90, "init_weights": str(weights), "wrap_policy": ["Block"]})
    assert options.hybrid is True  # a replicate size above 1 means hybrid sharding
    assert options.timeout == timedelta(seconds=90)
    assert options.init_weights == Path(weights)
    assert options.wrap_policy.class_names == frozenset({"Block"})
    assert options.activation_checkpointing_policy is None
    assert type(options.offload_policy) is OffloadPolicy  # "no offload" is a policy object too
    assert STATE_DICT_TYPES == ("auto", "sharded", "full")


@pytest.mark.parametrize(("option", "value", "error"), [("meta_init", 1, TypeError), ("shard_size", 0, ValueError)])
def test_a_wrong_value_is_refused_by_the_options_module_itself(option, value, error):
    with pytest.raises(error, match=f"`{option}`"):
        check_options(**{**DEFAULTS, option: value})


def test_every_strategy_parameter_is_an_option_and_every_option_a_parameter():
    # A new option declared in one place only would be half-declared: accepted and ignored, or never settable.
    parameters = set(inspect.signature(FSDP2Strategy.__init__).parameters) - {"self"}
    checked = set(inspect.signature(check_options).parameters)
    # `cpu_offload` is kept as the offload policy it selects.
    fields = {field.name for field in dataclasses.fields(Options)} - {"offload_policy"} | {"cpu_offload"}
    assert parameters == checked == fields
