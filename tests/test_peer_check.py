"""``integration_tests/peer/check.py``, its rules in ``testkit/peer_results.py``: a Lightning test that passes
unmodified and fails under "fsdp2" fails the peer run unless docs/compatibility.md lists it as a deliberate difference."""

from __future__ import annotations

from testkit.peer_results import (
    COMPATIBILITY,
    deliberate_differences,
    regressions,
)


def row(test: str, baseline: str, fsdp2: str) -> dict:
    return {"id": test, "baseline": [baseline, "", 1.0], "fsdp2": [fsdp2, "", 1.0]}


def test_the_documented_differences_are_read_from_the_compatibility_page():
    listed = deliberate_differences(COMPATIBILITY.read_text())
    assert "test_pruning.py::test_pruning_callback_ddp_cpu" in listed
    assert all("::" in test for test in listed)


def test_only_unlisted_failures_of_tests_that_pass_unmodified_are_regressions():
    results = {
        "passes": ["baseline", "fsdp2"],
        "rows": [
            row("tests_pytorch/a.py::test_ok", "PASS", "PASS"),
            row("tests_pytorch/b.py::test_broken_anyway", "FAIL", "FAIL"),
            row("tests_pytorch/callbacks/c.py::test_listed", "PASS", "FAIL"),
            row("tests_pytorch/d.py::test_new_break", "PASS", "TIMEOUT"),
        ],
    }
    unlisted, listed = regressions(results, ["c.py::test_listed"])
    assert unlisted == ["tests_pytorch/d.py::test_new_break: TIMEOUT"]
    assert listed == ["tests_pytorch/callbacks/c.py::test_listed: FAIL"]
