"""What a run of Lightning's own tests under "fsdp2" (``.ci/peer``) is judged by: the deliberate differences listed
in docs/compatibility.md, and the failures among tests that pass unmodified that are not among them. Read by
``integration_tests/peer/check.py`` and its unit test. Standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["COMPATIBILITY", "deliberate_differences", "regressions"]

COMPATIBILITY = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"


def deliberate_differences(text: str) -> list[str]:
    """The test ids listed in the "Deliberate differences" table."""
    section = text.split("### Deliberate differences", 1)[1].split("\n#", 1)[0]
    ids = []
    for line in section.splitlines():
        match = re.match(r"^\|\s*`([^`]+)`\s*\|", line)
        if match:
            ids.append(match.group(1))
    return ids


def regressions(results: dict, allowed: list[str]) -> tuple[list[str], list[str]]:
    """(unlisted failures, listed ones) among the tests that pass unmodified and not under the target."""
    target = [name for name in results["passes"] if name != "baseline"][0]
    unlisted, listed = [], []
    for row in results["rows"]:
        if row["baseline"][0] == "PASS" and row[target][0] != "PASS":
            (listed if any(row["id"].endswith(a) for a in allowed) else unlisted).append(
                f"{row['id']}: {row[target][0]}"
            )
    return unlisted, listed
