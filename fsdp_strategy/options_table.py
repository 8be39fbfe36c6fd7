"""The README's options table, rendered from the options' one declaration (:data:`fsdp_strategy.options.OPTIONS`).

``python -m fsdp_strategy.options_table`` prints it; tests/test_options.py holds the README to it. (The package
does not import this module, so that ``python -m`` runs it once.)
"""

from __future__ import annotations

from typing import Any

from fsdp_strategy.options import OPTIONS

__all__ = ["markdown_table"]


def markdown_table() -> str:
    """One row per option, in the order of the strategy's keywords."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    rows += [f"| `{spec.name}` | `{_default(spec.default)}` | {spec.help} |" for spec in OPTIONS]
    return "\n".join(rows) + "\n"


def _default(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


if __name__ == "__main__":
    print(markdown_table(), end="")
