"""Fails when a Lightning test that passes unmodified fails under "fsdp2" without being a documented difference.

    python integration_tests/peer/check.py RESULTS_DIR [RESULTS_DIR ...]

Each RESULTS_DIR is one run of the peer harness (its ``results.json``). The deliberate differences are the test ids
in the first column of the "Deliberate differences" table of docs/compatibility.md (matched as the end of the id);
each must say why it differs and what a user does instead (:mod:`testkit.peer_results`). Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # testkit/, beside the package
from testkit.peer_results import COMPATIBILITY, deliberate_differences, regressions  # noqa: E402


def main(directories: list[str]) -> int:
    allowed = deliberate_differences(COMPATIBILITY.read_text())
    failed = False
    for directory in directories:
        results = json.loads((Path(directory) / "results.json").read_text())
        unlisted, listed = regressions(results, allowed)
        passing = sum(1 for row in results["rows"] if row["baseline"][0] == "PASS")
        print(
            f"{directory}: {passing - len(unlisted) - len(listed)}/{passing} tests that pass unmodified pass under fsdp2;"
            f" {len(listed)} documented difference(s), {len(unlisted)} regression(s)"
        )
        for line in unlisted:
            print(f"  REGRESSION {line}")
        failed |= bool(unlisted)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
