"""The one positive-int check behind the strategy's, the estimator's, the mesh's and the monitor's options."""

from __future__ import annotations

import re

import pytest

from fsdp_strategy.option_checks import check_positive_int


@pytest.mark.parametrize("value", [1, 8, 2**40])
def test_positive_ints_pass(value):
    check_positive_int("world_size", value)


@pytest.mark.parametrize("value", [0, -3])
def test_a_count_out_of_range_is_a_value_error(value):
    with pytest.raises(ValueError, match=re.escape(f"`world_size` must be a positive int; got {value}.")):
        check_positive_int("world_size", value)


@pytest.mark.parametrize(("value", "type_name"), [(True, "bool"), (2.0, "float"), ("2", "str"), (None, "NoneType")])
def test_a_value_of_the_wrong_type_is_a_type_error(value, type_name):
    message = f"`shard_size` must be a positive int or None; got {value!r} of type {type_name}."
    with pytest.raises(TypeError, match=re.escape(message)):
        check_positive_int("shard_size", value, accepted="a positive int or None")
