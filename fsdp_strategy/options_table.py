"""The README's options table, rendered from the options' one declaration (:data:`fsdp_strategy.options.OPTIONS`).

``python -m fsdp_strategy.options_table`` prints it, ``python -m fsdp_strategy.options_table README.md`` puts it in
place of the first table of that file's "## Options" section; tests/test_options.py holds the README to it. (The
package does not import this module, so that ``python -m`` runs it once.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fsdp_strategy.options import OPTIONS

__all__ = ["markdown_table", "readme_with_table"]


def markdown_table() -> str:
    """One row per option, in the order of the strategy's keywords."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    rows += [f"| `{spec.name}` | `{_default(spec.default)}` | {spec.help} |" for spec in OPTIONS]
    return "\n".join(rows) + "\n"


def _default(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def readme_with_table(readme: str) -> str:
    """``readme`` with the first table of its "## Options" section replaced by :func:`markdown_table`."""
    head, section = readme.split("\n## Options\n", 1)
    start = section.index("\n|") + 1
    end = section.index("\n\n", start)
    return f"{head}\n## Options\n{section[:start]}{markdown_table()}{section[end + 1 :]}"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
        path.write_text(readme_with_table(path.read_text()))
    else:
        print(markdown_table(), end="")
