"""A progress bar over tensors on stderr, for the commands that read a whole checkpoint."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar"]


def progress_bar(total: int, *, desc: str) -> Any:
    """A ``tqdm`` bar of ``total`` tensors, or ``None`` without tqdm (an optional dependency: no bar then)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, dynamic_ncols=True)
