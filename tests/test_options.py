"""The options module: what ``check_options`` derives from plain values, and what each accepted value of a choice
does in a fit. Each refusal's exact message is tested through ``FSDP2Strategy`` in test_strategy_options.py."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.distributed.fsdp import OffloadPolicy

from fsdp_strategy.checkpoint import verify
from fsdp_strategy.checkpoint.trainer_state import load_trainer_state
from fsdp_strategy.options import STATE_DICT_TYPES, Options, check_options
from fsdp_strategy.strategy import FSDP2Strategy
from testkit.models import TinyLM, token_loader

DEFAULTS = dict(
    wrap_policy="auto", activation_checkpointing_policy=None, reshard_after_forward=True, hybrid=False,
    replicate_size=None, shard_size=None, cpu_offload=False, mp_policy=None, sync_grads_each_micro_batch=False,
    compile_blocks=False, meta_init=False, state_dict_type="auto", async_save=False, init_weights=None,
    process_group_backend=None, timeout=1800,
)  # fmt: skip


def test_plain_values_become_the_forms_the_strategy_uses(tmp_path):
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"x")
    options = check_options(
        **{**DEFAULTS, "replicate_size": 2, "timeout": 90, "init_weights": str(weights), "wrap_policy": ["Block"]}
    )
    assert options.hybrid is True  # a replicate size above 1 means hybrid sharding
    assert options.timeout == timedelta(seconds=90)
    assert options.init_weights == Path(weights)
    assert options.wrap_policy.class_names == frozenset({"Block"})
    assert options.activation_checkpointing_policy is None
    assert type(options.offload_policy) is OffloadPolicy  # "no offload" is a policy object too


# What a save writes under each accepted value; "auto" writes one file when the full state fits in a quarter of rank
# 0's free host memory, as this model's does.
_WRITES = {"auto": "file", "full": "file", "sharded": "directory"}


@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
def test_each_state_dict_type_writes_its_form(trainer_env, tmp_path, state_dict_type):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(state_dict_type=state_dict_type),
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM(n_layer=1), token_loader(samples=8))
    path = tmp_path / "step1.ckpt"
    trainer.save_checkpoint(path)
    assert ("file" if path.is_file() else "directory" if path.is_dir() else None) == _WRITES[state_dict_type]
    # What was written is a checkpoint of this step in that form (resuming from each form: test_trainer_smoke.py).
    assert verify.is_sharded_checkpoint(path) == (_WRITES[state_dict_type] == "directory")
    step = (
        load_trainer_state(path)["global_step"]
        if path.is_dir()
        else torch.load(path, weights_only=False)["global_step"]
    )
    assert step == 1


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
