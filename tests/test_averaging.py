"""fsdp_strategy.sharding.averaging on a real 1-rank gloo group: Lightning's WeightAveraging with its copy sharded like the module."""

from __future__ import annotations

import copy
import re

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy._compat import averaged_model_of
from fsdp_strategy.checkpoint.layout import gather_dtensors, split_checkpoint
from fsdp_strategy.sharding.averaging import shard_like, unshard
from testkit import full
from testkit.models import TinyLM, token_loader


def sharded_model_and_average(mesh, *, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, AveragedModel]:
    """A sharded TinyLM and an EMA copy made before sharding, whose values differ from the module's."""
    torch.manual_seed(0)
    model = TinyLM()
    average = AveragedModel(model, avg_fn=get_ema_avg_fn(0.5), use_buffers=True).to(dtype)
    with torch.no_grad():
        for param in average.module.parameters():
            param.add_(1.0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, average


def test_the_copy_is_sharded_like_the_module_and_keeps_its_own_values_dtype_and_ties(mesh):
    model, average = sharded_model_and_average(mesh, dtype=torch.float64)
    before = {name: p.detach().clone() for name, p in average.module.named_parameters()}
    shard_like(average.module, model)
    sharded = dict(model.named_parameters())
    for name, param in average.module.named_parameters():
        assert isinstance(param, nn.Parameter) and isinstance(param, DTensor), name
        assert param.device_mesh == sharded[name].device_mesh and param.placements == sharded[name].placements, name
        assert param.dtype == torch.float64, name
        assert torch.equal(param.full_tensor(), before[name]), name
    assert average.module.head.weight is average.module.embed.weight  # still one tied parameter

    unshard(average.module)
    for name, param in average.module.named_parameters():
        assert type(param) is nn.Parameter and torch.equal(param, before[name]), name
    assert average.module.head.weight is average.module.embed.weight


def test_averaging_and_swapping_on_shards_gives_what_the_plain_copy_gives(mesh):
    model, average = sharded_model_and_average(mesh)
    reference_model = TinyLM()
    reference_model.load_state_dict({k: full(v) for k, v in model.state_dict().items()})
    reference = copy.deepcopy(average)
    shard_like(average.module, model)

    for _ in range(2):  # the first update copies, the next one averages
        with torch.no_grad():
            for param, ref in zip(model.parameters(), reference_model.parameters()):
                param.mul_(0.5)
                ref.mul_(0.5)
        average.update_parameters(model)
        reference.update_parameters(reference_model)
    for (name, param), ref in zip(average.module.named_parameters(), reference.module.parameters()):
        assert isinstance(param, DTensor), name
        torch.testing.assert_close(param.full_tensor(), ref, rtol=0, atol=0)
    # Lightning's swap copies shard into shard: the module then holds the average.
    for avg, current in zip(average.module.parameters(), model.parameters()):
        tmp = avg.data.clone()
        avg.data.copy_(current.data)
        current.data.copy_(tmp)
    for param, ref in zip(model.parameters(), reference.module.parameters()):
        torch.testing.assert_close(full(param), ref, rtol=0, atol=0)


def test_a_copy_that_does_not_match_the_module_names_the_parameter(mesh):
    model, average = sharded_model_and_average(mesh)
    average.module.extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=re.escape("parameter 'extra' that the sharded module lacks")):
        shard_like(average.module, model)


def test_sharded_state_a_callback_adds_is_saved_with_the_shards_or_gathered_for_a_file(mesh):
    model, average = sharded_model_and_average(mesh)
    shard_like(average.module, model)
    checkpoint = {
        "state_dict": {"w": torch.ones(2)},
        "current_model_state": dict(model.state_dict()),
        "averaging_state": {"n_averaged": torch.tensor(3)},
        "epoch": 1,
    }
    tensors, rest = split_checkpoint(checkpoint)
    assert set(tensors) == {"model", "current_model_state"}
    assert set(rest) == {"averaging_state", "epoch"}

    gathered = gather_dtensors(checkpoint, keep=True)
    for name, value in gathered["current_model_state"].items():
        assert type(value) is torch.Tensor and torch.equal(value, full(model.state_dict()[name])), name
    assert gathered["averaging_state"] is checkpoint["averaging_state"]
    dropped = gather_dtensors(checkpoint, keep=False)  # other ranks keep no full tensor
    assert all(value is None for value in dropped["current_model_state"].values())


def trainer(tmp_path, strategy, callbacks, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, default_root_dir=tmp_path, logger=False, max_steps=4,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=2,
        val_check_interval=2, callbacks=callbacks, **kwargs,
    )  # fmt: skip


def test_ema_on_one_rank_matches_ddp_and_the_copy_is_whole_again_after_fit(trainer_env, tmp_path):
    results = {}
    for name, strategy in [("ddp", "ddp"), ("fsdp2", FSDP2Strategy(state_dict_type="sharded"))]:
        trainer_env.fresh()
        L.seed_everything(3)
        callback = EMAWeightAveraging(decay=0.7)
        model = TinyLM()
        trainer(tmp_path / name, strategy, [callback]).fit(
            model, token_loader(batch_size=4, samples=16), token_loader(batch_size=4, samples=8)
        )
        average = averaged_model_of(callback).module
        assert not any(isinstance(p, DTensor) for p in average.parameters())  # whole again after fit, as under DDP
        results[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, value in results["ddp"].items():
        torch.testing.assert_close(results["fsdp2"][key], value, rtol=1e-5, atol=1e-6)


def test_stochastic_weight_averaging_is_refused_naming_the_sharded_alternative(trainer_env, tmp_path):
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    message = "StochasticWeightAveraging does not support sharded models"
    with pytest.raises(MisconfigurationException, match=re.escape(message)) as refused:
        trainer(tmp_path, "fsdp2", [StochasticWeightAveraging(swa_lrs=0.1)]).fit(
            TinyLM(), token_loader(batch_size=4, samples=16)
        )
    assert "Use `lightning.pytorch.callbacks.WeightAveraging`" in str(refused.value)


def test_a_module_built_on_the_meta_device_is_refused_before_the_callback_copies_it(trainer_env, tmp_path):
    run = trainer(tmp_path, FSDP2Strategy(), [EMAWeightAveraging()])
    with run.init_module(empty_init=True):
        model = TinyLM()
    message = (
        "EMAWeightAveraging cannot average a module built on the meta device (`trainer.init_module(empty_init=True)`)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        run.fit(model, token_loader(batch_size=4, samples=16))
