"""The names ``Trainer(strategy=...)`` accepts for ``FSDP2Strategy``, each with the options it presets.

Importing :mod:`fsdp_strategy` registers them with Lightning's ``StrategyRegistry``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["STRATEGY_NAMES", "register_strategy_names"]

STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "fsdp2": ("Fully sharded data parallel (FSDP2, ZeRO-3)", {}),
    "fsdp2_grad_op": (
        "FSDP2 keeping parameters gathered between forward and backward",
        {"reshard_after_forward": False},
    ),
    "fsdp2_hybrid": ("FSDP2 sharding within a node and replicating across nodes", {"hybrid": True}),
    # ModelParallelStrategy's defaults: tensor parallelism over a node's devices, sharding across the nodes.
    "fsdp2_tp": (
        "FSDP2 across nodes with tensor parallelism over the devices of each node",
        {"tensor_parallel_size": "auto"},
    ),
    "fsdp2_offload": ("FSDP2 with sharded state offloaded to host memory (CUDA)", {"cpu_offload": True}),
    # "fsdp2" always does what DDP needs find_unused_parameters=True for; the name eases the switch.
    "fsdp2_find_unused_parameters_true": ("FSDP2 (parameters unused on some ranks are always handled)", {}),
}
"""Each name's description (``StrategyRegistry.available_strategies()`` lists them) and preset options."""


def register_strategy_names(registry: Any, strategy_class: type) -> None:
    """Registers every name of :data:`STRATEGY_NAMES` for ``strategy_class`` in ``registry``."""
    for name, (description, init_params) in STRATEGY_NAMES.items():
        registry.register(name, strategy_class, description=description, override=True, **init_params)
