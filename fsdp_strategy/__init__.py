"""Train any LightningModule with FSDP2 by changing one flag: ``Trainer(strategy="fsdp2")``.

Importing this package registers the strategy names ``"fsdp2"``, ``"fsdp2_grad_op"``,
``"fsdp2_hybrid"``, ``"fsdp2_offload"`` and ``"fsdp2_find_unused_parameters_true"`` with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from fsdp_strategy.checkpoint.errors import CheckpointError
from fsdp_strategy.checkpoint.saving import CheckpointSaveError
from fsdp_strategy.estimator.model_state import Estimate, estimate_module
from fsdp_strategy.estimator.report import estimate
from fsdp_strategy.launch.rendezvous import PeerLostError
from fsdp_strategy.monitor import ShardingMonitor
from fsdp_strategy.plugins.precision import SUPPORTED_PRECISIONS
from fsdp_strategy.sharding.policy import PolicyInput
from fsdp_strategy.step.guard import NonFiniteGradientError
from fsdp_strategy.step.unit_order import UnitMismatchError
from fsdp_strategy.strategy import FSDP2Strategy
from fsdp_strategy.tools.consolidate import consolidate_checkpoint
from fsdp_strategy.tools.export import export_safetensors

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
