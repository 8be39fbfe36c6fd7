"""Train any LightningModule with FSDP2 by changing one flag: ``Trainer(strategy="fsdp2")``.

Importing this package registers the strategy names ``"fsdp2"``, ``"fsdp2_grad_op"``,
``"fsdp2_hybrid"``, ``"fsdp2_offload"`` and ``"fsdp2_find_unused_parameters_true"`` with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from fsdp_strategy.consolidate import consolidate_checkpoint
from fsdp_strategy.export import export_safetensors
from fsdp_strategy.estimate import Estimate, estimate_module
from fsdp_strategy.estimate_report import estimate
from fsdp_strategy.guard import NonFiniteGradientError
from fsdp_strategy.checkpoint_error import CheckpointError
from fsdp_strategy.monitor import ShardingMonitor
from fsdp_strategy.policy import PolicyInput
from fsdp_strategy.precision import SUPPORTED_PRECISIONS
from fsdp_strategy.rendezvous import PeerLostError
from fsdp_strategy.saving import CheckpointSaveError
from fsdp_strategy.strategy import FSDP2Strategy
from fsdp_strategy.unit_order import UnitMismatchError

__all__ = [
    "SUPPORTED_PRECISIONS",
    "CheckpointError",
    "CheckpointSaveError",
    "Estimate",
    "FSDP2Strategy",
    "NonFiniteGradientError",
    "PeerLostError",
    "PolicyInput",
    "ShardingMonitor",
    "UnitMismatchError",
    "__version__",
    "consolidate_checkpoint",
    "estimate",
    "estimate_module",
    "export_safetensors",
]
__version__ = "0.1.0"

FSDP2Strategy.register_strategies(StrategyRegistry)
