"""Wrap / activation-checkpointing policies: the accepted forms, their errors, and what they select."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fsdp_strategy.sharding.policy import ModulePolicy, normalize_policy, select_modules
from testkit.models import Block, TinyLM

ACCEPTED = (
    '"auto", a list of module class names (e.g. ["Block"]), a set of nn.Module classes, a callable'
    " (name, module) -> bool, a positive int (minimum parameters per unit), or None"
)


class Layer(nn.Module):
    """20 + 6 parameters in two children, and 10 of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.small = nn.Linear(2, 2)
        self.act = nn.ReLU()
        self.gain = nn.Parameter(torch.ones(10))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.out = nn.Linear(4, 2)


def names(selected: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in selected]


def policy(value, option: str = "wrap_policy") -> ModulePolicy:
    normalized = normalize_policy(value, option=option)
    assert normalized is not None
    return normalized


# --- normalization: accepted forms ------------------------------------------------------------------


def test_none_policy_stays_none():
    assert normalize_policy(None, option="wrap_policy") is None


def test_auto_policy_normalizes_to_auto_and_keeps_the_option_name():
    normalized = policy("auto", option="activation_checkpointing_policy")
    assert normalized.auto
    assert normalized.option == "activation_checkpointing_policy"
    assert normalized.describe() == '"auto"'


def test_single_class_name_string_becomes_one_class_name():
    assert policy("Block").class_names == frozenset({"Block"})


def test_list_of_class_names_becomes_class_name_set():
    normalized = policy(["Block", "LayerNorm", "Block"])
    assert normalized.class_names == frozenset({"Block", "LayerNorm"})
    assert normalized.classes == ()
    assert normalized.describe() == "['Block', 'LayerNorm']"


def test_set_of_classes_becomes_classes():
    normalized = policy({Block})
    assert normalized.classes == (Block,)
    assert normalized.class_names == frozenset()
    assert normalized.describe() == "['Block']"


def test_single_module_class_is_accepted_as_a_class_not_as_a_callable():
    normalized = policy(Block)
    assert normalized.classes == (Block,)
    assert normalized.predicate is None


def test_mixed_names_and_classes_are_split():
    normalized = policy(("Linear", Block))
    assert normalized.class_names == frozenset({"Linear"})
    assert normalized.classes == (Block,)
    assert normalized.describe() == "['Block', 'Linear']"


def test_callable_becomes_predicate():
    def is_block(name: str, module: nn.Module) -> bool:
        return isinstance(module, Block)

    normalized = policy(is_block)
    assert normalized.predicate is is_block
    assert normalized.describe() == repr(is_block)


def test_positive_int_becomes_minimum_parameter_count():
    normalized = policy(1000)
    assert normalized.min_params == 1000
    assert normalized.describe() == "1000 (minimum parameters)"


# --- normalization: errors --------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, False])
def test_bool_policy_is_rejected_with_the_accepted_forms(value):
    with pytest.raises(TypeError, match=re.escape(f"`wrap_policy` must be {ACCEPTED}; got the bool {value!r}.")):
        normalize_policy(value, option="wrap_policy")


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_string_policy_is_rejected(value):
    with pytest.raises(ValueError, match=re.escape(f"`wrap_policy` must be {ACCEPTED}; got the empty string.")):
        normalize_policy(value, option="wrap_policy")


@pytest.mark.parametrize("value", [0, -5])
def test_non_positive_int_policy_is_rejected(value):
    message = f"`wrap_policy` as a minimum parameter count must be a positive int; got {value}."
    with pytest.raises(ValueError, match=re.escape(message)):
        normalize_policy(value, option="wrap_policy")


def test_float_policy_is_rejected_with_value_and_type():
    with pytest.raises(TypeError, match=re.escape(f"`wrap_policy` must be {ACCEPTED}; got 3.5 of type float.")):
        normalize_policy(3.5, option="wrap_policy")


def test_list_with_a_non_class_entry_names_the_bad_entry():
    message = "`wrap_policy` entries must be class names (str) or nn.Module subclasses; got 3 of type int."
    with pytest.raises(TypeError, match=re.escape(message)):
        normalize_policy([Block, 3], option="wrap_policy")


@pytest.mark.parametrize(("value", "kind"), [([], "list"), (set(), "set"), ((), "tuple")])
def test_empty_collection_policy_is_rejected(value, kind):
    message = f"`activation_checkpointing_policy` must name at least one module class; got an empty {kind}."
    with pytest.raises(ValueError, match=re.escape(message)):
        normalize_policy(value, option="activation_checkpointing_policy")


# --- selection --------------------------------------------------------------------------------------


def test_class_name_selection_is_post_order_children_before_parents():
    model = Net()
    selected = names(select_modules(model, policy(["Layer", "Linear"])))
    assert selected == [
        "out",
        "layers.1.small",
        "layers.1.proj",
        "layers.1",
        "layers.0.small",
        "layers.0.proj",
        "layers.0",
    ]
    for i, name in enumerate(selected):  # no module is listed before one of its descendants
        assert not any(later.startswith(name + ".") for later in selected[i + 1 :])


def test_class_selection_matches_subclasses_by_isinstance():
    class SpecialLinear(nn.Linear):
        pass

    model = nn.Sequential(SpecialLinear(2, 2), nn.ReLU())
    assert names(select_modules(model, policy({nn.Linear}))) == ["0"]


def test_predicate_receives_qualified_names_and_excludes_the_root():
    seen = []

    def record(name: str, module: nn.Module) -> bool:
        seen.append(name)
        return name.endswith("proj")

    model = Net()
    assert names(select_modules(model, policy(record))) == ["layers.1.proj", "layers.0.proj"]
    assert "" not in seen
    assert seen == [name for name, _ in model.named_modules()][1:]


def test_auto_finds_the_repeated_blocks_of_tinylm():
    model = TinyLM()
    expected = [f"blocks.{i}" for i in reversed(range(len(model.blocks)))]
    selected = select_modules(model, policy("auto"))
    assert names(selected) == expected
    assert all(isinstance(module, Block) for _, module in selected)


def test_auto_keeps_the_outermost_repeated_blocks_only():
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    model = nn.Module()
    model.layers = nn.ModuleList([Inner(), Inner()])
    assert names(select_modules(model, policy("auto"))) == ["layers.1", "layers.0"]


def test_auto_ignores_parameterless_and_unrepeated_children():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.ReLU(), nn.LayerNorm(2))
    assert select_modules(model, policy("auto")) == []


def test_auto_respects_no_split_modules_over_the_container_heuristic():
    class Backbone(nn.Module):
        _no_split_modules = ["Layer"]  # Hugging Face style, declared on a submodule

        def __init__(self) -> None:
            super().__init__()
            self.first = Layer()
            self.second = Layer()
            self.adapters = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # repeated, but not a no-split class

    model = nn.Module()
    model.backbone = Backbone()
    assert names(select_modules(model, policy("auto"))) == ["backbone.second", "backbone.first"]


def test_min_params_selects_bottom_up_counting_only_unassigned_parameters():
    model = Net()  # Layer: proj 20, small 6, own gain 10; out: 10
    # proj reaches 15 on its own; each Layer then still holds 10 + 6 = 16 unassigned parameters.
    assert names(select_modules(model, policy(15))) == ["layers.0.proj", "layers.0", "layers.1.proj", "layers.1"]
    # No Layer part reaches 40, a whole Layer has 36: the ModuleList (72) is the first to reach it.
    assert names(select_modules(model, policy(40))) == ["layers"]


def test_min_params_counts_every_module_with_parameters_at_one():
    assert names(select_modules(Net(), policy(1))) == [
        "layers.0.proj",
        "layers.0.small",
        "layers.0",
        "layers.1.proj",
        "layers.1.small",
        "layers.1",
        "out",
    ]


# --- selection: errors ------------------------------------------------------------------------------


def test_class_name_absent_from_the_model_lists_the_model_classes():
    message = (
        "`wrap_policy` names module classes that are not in the model: ['Attention', 'Block']. The model's"
        " module classes are: ['Layer', 'Linear', 'ModuleList', 'ReLU']."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        select_modules(Net(), policy(["Block", "Linear", "Attention"]))


def test_class_absent_from_the_model_matches_nothing():
    with pytest.raises(ValueError, match=re.escape("`wrap_policy=['Conv2d']` matches no submodule of Net.")):
        select_modules(Net(), policy({nn.Conv2d}))


def test_predicate_that_selects_nothing_is_an_error_naming_the_option():
    def never(name: str, module: nn.Module) -> bool:
        return False

    message = f"`activation_checkpointing_policy={never!r}` matches no submodule of Net."
    with pytest.raises(ValueError, match=re.escape(message)):
        select_modules(Net(), policy(never, option="activation_checkpointing_policy"))


def test_min_params_larger_than_any_submodule_matches_nothing():
    message = "`wrap_policy=1000000 (minimum parameters)` matches no submodule of Net."
    with pytest.raises(ValueError, match=re.escape(message)):
        select_modules(Net(), policy(1_000_000))


def test_a_class_that_is_not_a_module_is_rejected_not_taken_as_a_predicate():
    message = f"`wrap_policy` must be {ACCEPTED}; got the class dict, which is not an nn.Module."
    with pytest.raises(TypeError, match=re.escape(message)):
        normalize_policy(dict, option="wrap_policy")


def test_auto_falls_back_to_repeated_blocks_when_no_split_modules_names_nothing_present():
    model = TinyLM()
    model._no_split_modules = ["LlamaDecoderLayer"]
    selected = select_modules(model, normalize_policy("auto", option="wrap_policy"))
    assert [name for name, _ in selected] == ["blocks.2", "blocks.1", "blocks.0"]


def test_class_names_match_modules_the_user_already_sharded(single_rank_group):
    from torch.distributed.fsdp import fully_shard

    from fsdp_strategy.sharding.policy import class_name

    model = TinyLM()
    fully_shard(model.blocks[0])
    assert type(model.blocks[0]).__name__ == "FSDPBlock"
    assert class_name(model.blocks[0]) == "Block"
    selected = select_modules(model, normalize_policy(["Block"], option="wrap_policy"))
    assert [name for name, _ in selected] == ["blocks.2", "blocks.1", "blocks.0"]
