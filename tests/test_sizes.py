"""Byte counts as text and back: the one formatter every message and table uses, the budget parser."""

from __future__ import annotations

import re

import pytest

from fsdp_strategy.sizes import format_bytes, parse_bytes

SIZE_FORMS = "a size like 80GiB, 80GB, 512MiB or 1.5TiB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), or plain bytes"


def raises(exception: type[Exception], message: str):
    return pytest.raises(exception, match=re.escape(message))


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 TiB", 3 * 2**39),
        ("1024", 1024),
        ("64kb", 64000),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["80 gigs", "GiB", "-1GiB", "", "8 G"])
def test_parse_bytes_names_the_option_value_and_forms(text):
    with raises(ValueError, f"`--budget` must be {SIZE_FORMS}; got {text!r}."):
        parse_bytes(text, option="--budget")


@pytest.mark.parametrize("value", [0, "0GiB"])
def test_parse_bytes_refuses_zero(value):
    with raises(ValueError, f"`budget` must be positive: {SIZE_FORMS}; got {value!r}."):
        parse_bytes(value)


def test_format_bytes():
    sizes = (0, 1023, 1024, 9.1 * 2**30, 3 * 2**40)
    assert [format_bytes(n) for n in sizes] == ["0 B", "1023 B", "1.0 KiB", "9.1 GiB", "3.0 TiB"]


@pytest.mark.parametrize(
    ("size", "text"),
    [(2**20 - 1, "1024.0 KiB"), (2**20, "1.0 MiB"), (2**30 - 1, "1024.0 MiB"), (2**30, "1.0 GiB"), (2**40, "1.0 TiB")],
)
def test_format_bytes_changes_unit_at_each_power_of_1024(size, text):
    # The consolidate summary and the save errors print with it too (they had copies of their own).
    assert format_bytes(size) == text
