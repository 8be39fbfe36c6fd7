"""Optimizers under FSDP2: which run on shards as they are, which this package runs distributed, which are refused.

:mod:`.kinds` classifies each optimizer once, before the first step; :mod:`.install` puts the distributed steps of
:mod:`.muon` and :mod:`.adafactor` in place of the optimizers' own; :mod:`.rows` and :mod:`.owners` are the two
ways those steps see more than a shard: partial sums over the rows of a parameter, and whole matrices on owner ranks.
"""

from fsdp_strategy.optim.install import ShardedOptimizers
from fsdp_strategy.optim.kinds import OptimizerKind, classify

__all__ = ["OptimizerKind", "ShardedOptimizers", "classify"]
