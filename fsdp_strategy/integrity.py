"""The import path of the checkpoint checks before they were split, kept for the names the README gave.

The checks now live by concern: :mod:`fsdp_strategy.dcp_metadata` (DCP's ``.metadata``, read without
running code), :mod:`fsdp_strategy.verify` (shard files, half-written directories, keys and shapes against
the model) and :mod:`fsdp_strategy.trainer_state` (``meta.pt``: what is saved, what loading accepts).
"""

from fsdp_strategy.checkpoint_error import CheckpointError
from fsdp_strategy.trainer_state import ACCEPTED_TYPES

__all__ = ["ACCEPTED_TYPES", "CheckpointError"]
