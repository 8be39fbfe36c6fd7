"""The options module: what ``check_options`` derives from plain values, and what each accepted value of a choice
does in a fit. Each refusal's exact message is tested through ``FSDP2Strategy`` in test_strategy_options.py."""

from __future__ import annotations

import inspect
import re
from datetime import timedelta
from pathlib import Path

import docstring_parser
import lightning as L
import pytest
import torch
from torch.distributed.fsdp import OffloadPolicy

from fsdp_strategy.checkpoint import verify
from fsdp_strategy.checkpoint.trainer_state import load_trainer_state
from fsdp_strategy.modes import StateDictType
from fsdp_strategy.options import OPTIONS, check_options
from fsdp_strategy.options_table import markdown_table, readme_with_table
from fsdp_strategy.strategy import FSDP2Strategy
from testkit.models import TinyLM, token_loader


def test_plain_values_become_the_forms_the_strategy_uses(tmp_path):
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"x")
    options = check_options(replicate_size=2, timeout=90, init_weights=str(weights), wrap_policy=["Block"])
    assert options.hybrid is True  # a replicate size above 1 means hybrid sharding
    assert options.timeout == timedelta(seconds=90)
    assert options.init_weights == Path(weights)
    assert options.wrap_policy.class_names == frozenset({"Block"})
    assert options.activation_checkpointing_policy is None
    assert type(options.offload_policy) is OffloadPolicy  # "no offload" is a policy object too


# What a save writes under each accepted value; "auto" writes one file when the full state fits in a quarter of rank
# 0's free host memory, as this model's does.
_WRITES = {"auto": "file", "full": "file", "sharded": "directory", "adapter": "directory"}


@pytest.mark.parametrize("state_dict_type", [mode.value for mode in StateDictType])
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
        check_options(**{option: value})


def test_the_strategy_signature_is_the_table_of_options():
    # A new option declared in one place only would be half-declared: accepted and ignored, or never settable. The
    # signature stays written out (LightningCLI and jsonargparse read it), so it is held to the table here.
    parameters = inspect.signature(FSDP2Strategy.__init__, eval_str=True).parameters
    keywords = [p for name, p in parameters.items() if name != "self"]
    assert [p.name for p in keywords] == [spec.name for spec in OPTIONS]
    for parameter, spec in zip(keywords, OPTIONS):
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, spec.name
        assert parameter.default == spec.default and type(parameter.default) is type(spec.default), spec.name
        assert parameter.annotation == spec.accepts, spec.name


def test_the_defaults_of_the_table_are_the_strategy_defaults_checked():
    defaults = check_options()
    assert FSDP2Strategy().options == defaults
    assert defaults.state_dict_type is StateDictType.AUTO  # a mode is held as its enum


def test_an_unknown_option_is_refused_by_name():
    with pytest.raises(TypeError, match=re.escape("check_options() got unknown options ['hybird']")):
        check_options(hybird=True)


def test_the_readme_options_table_is_the_one_rendered_from_the_options():
    # Regenerate it with `python -m fsdp_strategy.options_table README.md` after changing an option.
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    first_table = section[section.index("\n|") + 1 :].split("\n\n", 1)[0] + "\n"
    assert first_table == markdown_table()


def test_the_table_is_put_in_place_of_a_stale_one_and_nothing_else_changes():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    stale = readme.replace(
        markdown_table(), "| option | default | meaning |\n|---|---|---|\n| `gone` | `1` | old |\n", 1
    )
    assert stale != readme
    assert readme_with_table(stale) == readme


def test_lightning_cli_help_shows_each_option_meaning():
    # LightningCLI (jsonargparse) reads a keyword's help from the docstring with docstring_parser.
    docstring = docstring_parser.parse(FSDP2Strategy.__init__.__doc__)
    assert {param.arg_name: param.description for param in docstring.params} == {
        spec.name: f"{spec.help}." for spec in OPTIONS
    }
