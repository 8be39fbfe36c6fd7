"""Layer types as DDP shows them while sharded (``fsdp_strategy.sharding.class_names``), on a real 1-rank group; the
2-rank comparison of ``summarize`` with DDP during and after a fit is in ``integration_tests/test_dropin.py``."""

from __future__ import annotations

from lightning.pytorch.utilities.model_summary import summarize
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdp_strategy.sharding.class_names import PlainClassNames, module_class
from testkit.models import Block, TinyLM


def test_sharded_classes_show_their_module_class_name_until_restored(mesh):
    model = TinyLM(n_layer=2)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded_types = summarize(model, max_depth=2).layer_types
    assert sharded_types[:3] == ["Embedding", "ModuleList", "FSDPBlock"]
    names = PlainClassNames()
    names.show(model)
    assert summarize(model, max_depth=2).layer_types == [name.removeprefix("FSDP") for name in sharded_types]
    assert repr(model).startswith("TinyLM(") and "2 x Block(" in repr(model)
    assert isinstance(model.blocks[0], FSDPModule) and isinstance(model.blocks[0], Block)
    assert type(model.blocks[0]).__qualname__ == "FSDPBlock"  # what type(module) prints still says it is sharded
    names.show(model)  # twice: still the names they had before the first
    names.restore()
    assert type(model.blocks[0]).__name__ == "FSDPBlock" and type(model).__name__ == "FSDPTinyLM"


def test_module_class_is_the_class_under_fully_shards_class(mesh):
    layer = nn.Linear(2, 2)
    fully_shard(layer, mesh=mesh)
    assert module_class(type(layer)) is nn.Linear
    assert module_class(nn.Linear) is None
