"""``frozen_dtype``: the option's checks, frozen parameters cast (or quantized to NF4) before sharding while trainable
ones keep their dtype, a 1-rank fit with a bf16 frozen base, and the estimator's bytes for frozen parameters."""

from __future__ import annotations

import importlib.util
import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.estimator.model_state import estimate_module
from fsdp_strategy.options import check_options
from fsdp_strategy.sharding.frozen import nf4_available, nf4_fits, store_frozen, torchao_to_nf4
from fsdp_strategy.tools.cli import main
from testkit.frozen import FrozenBaseRegressor
from testkit.models import TinyLM, token_loader


def frozen_backbone_lm() -> TinyLM:
    """TinyLM with its blocks frozen; the tied embedding/head, the norms and the scale train."""
    model = TinyLM()
    model.blocks.requires_grad_(False)
    return model


def test_frozen_dtype_accepts_none_the_half_dtypes_and_nf4():
    assert check_options().frozen_dtype is None
    assert check_options(frozen_dtype="bfloat16").frozen_dtype == "bfloat16"
    assert check_options(frozen_dtype="float16").frozen_dtype == "float16"


def test_a_frozen_dtype_that_is_not_a_str_or_not_accepted_is_refused_naming_the_choices():
    with pytest.raises(TypeError) as error:
        check_options(frozen_dtype=torch.bfloat16)
    assert str(error.value) == (
        "`frozen_dtype` must be one of ('bfloat16', 'float16', 'nf4') or None; got torch.bfloat16 of type dtype."
    )
    with pytest.raises(ValueError) as error:
        check_options(frozen_dtype="int8")
    assert str(error.value) == "`frozen_dtype` must be one of ('bfloat16', 'float16', 'nf4') or None; got 'int8'."


def test_nf4_without_torchao_is_refused_naming_the_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    expected = (
        "`frozen_dtype='nf4'` needs torchao's NF4 tensor: `pip install torchao` (or `pip install"
        " fsdp-strategy[nf4]`); torchao is not installed here."
    )
    with pytest.raises(ImportError) as error:
        check_options(frozen_dtype="nf4")
    assert str(error.value) == expected
    with pytest.raises(ImportError) as error:
        store_frozen(nn.Linear(256, 64).requires_grad_(False), "nf4", shards=1)
    assert str(error.value) == expected


def test_frozen_parameters_are_cast_in_place_and_trainable_ones_keep_fp32():
    model = frozen_backbone_lm()
    block_weight, tied = model.blocks[0].attn_q.weight, model.head.weight
    expected = [p.detach().clone() for p in model.blocks.parameters()]
    frozen_count = len(list(model.blocks.parameters()))

    assert store_frozen(model, "bfloat16", shards=1) == frozen_count
    assert model.blocks[0].attn_q.weight is block_weight  # the same Parameter: optimizer groups still name it
    assert model.head.weight is model.embed.weight is tied  # a trainable tied weight stays tied, in fp32
    for param, before in zip(model.blocks.parameters(), expected):
        assert param.dtype == torch.bfloat16 and torch.equal(param, before.to(torch.bfloat16))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert store_frozen(model, "bfloat16", shards=1) == 0  # already stored so


def test_nf4_fits_whole_blocks_per_rank_only():
    assert nf4_fits((256, 64), 1)  # 16,384 values: one block of scales
    assert not nf4_fits((256, 64), 2)  # one block of scales cannot be split
    assert nf4_fits((256, 256), 4) and not nf4_fits((256, 256), 8)
    assert not nf4_fits((100, 64), 1) and not nf4_fits((16384,), 1)


def test_nf4_quantizes_the_frozen_linear_weights_that_fit_and_leaves_the_rest():
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128), nn.Linear(128, 8), nn.Linear(256, 128))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    original = model[0].weight.detach().clone()
    if not nf4_available():  # torchao missing, or a release that does not import with this torch
        with pytest.raises(
            ImportError, match=r"`frozen_dtype='nf4'` needs torchao's NF4 tensor: `pip install torchao`"
        ):
            store_frozen(model, "nf4", shards=2)
        return

    with pytest.raises(ValueError) as error:
        store_frozen(model, "nf4", shards=1)
    assert str(error.value) == (
        "`frozen_dtype='nf4'` needs 2 or more ranks to shard over; got a shard group of 1. On one process, train"
        ' without FSDP2 (`strategy="auto"`) with the frozen weights converted by torchao\'s `to_nf4`.'
    )
    assert store_frozen(model, "nf4", shards=2) == 1
    assert type(model[0].weight.data).__name__ == "NF4Tensor" and not model[0].weight.requires_grad
    expected = torchao_to_nf4()(original).get_original_weight()  # torchao's own quantization of the weight
    assert torch.equal(model[0].weight.get_original_weight(), expected)
    assert type(model[1].weight.data) is torch.Tensor  # trainable
    assert type(model[2].weight.data) is torch.Tensor  # too small for whole NF4 blocks
    assert model[0].bias.dtype == torch.float32  # a bias is not quantized


class FrozenDtypesWhileTraining(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        params = dict(pl_module.named_parameters())
        self.local_dtypes = {name: p.to_local().dtype for name, p in params.items() if isinstance(p, DTensor)}
        optimizer = trainer.optimizers[0]
        self.with_state = {name for name, p in params.items() if p in optimizer.state}


def test_a_one_rank_fit_keeps_the_frozen_shards_in_bf16_and_optimizer_state_for_trainable_ones(trainer_env, tmp_path):
    model = FrozenBaseRegressor()
    seen = FrozenDtypesWhileTraining()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(frozen_dtype="bfloat16"),
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=2,
        callbacks=[seen],
    )
    data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 3))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))

    frozen_names = {name for name in seen.local_dtypes if name.startswith("base.")}
    assert frozen_names and all(seen.local_dtypes[name] == torch.bfloat16 for name in frozen_names)
    trainable_names = set(seen.local_dtypes) - frozen_names
    assert trainable_names and all(seen.local_dtypes[name] == torch.float32 for name in trainable_names)
    assert seen.with_state == trainable_names
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_frozen_dtype_with_a_meta_initialized_module_is_refused_before_sharding(trainer_env, tmp_path):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(frozen_dtype="bfloat16"),
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        max_steps=1,
    )
    with trainer.init_module(empty_init=True):
        model = frozen_backbone_lm()
    with pytest.raises(ValueError, match=r"`frozen_dtype='bfloat16'` needs the module's parameters built before"):
        trainer.fit(model, token_loader(batch_size=4, samples=8))


def test_the_estimate_counts_frozen_parameters_without_gradients_or_optimizer_state_in_their_dtype():
    model = frozen_backbone_lm()
    frozen_numel = sum(p.numel() for p in model.blocks.parameters())
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    trainable_numel, tensors = sum(p.numel() for p in trainable), len(trainable)

    for frozen_dtype, frozen_bytes in ((None, 4), ("bfloat16", 2), ("float16", 2)):
        row = estimate_module(model, strategy="fsdp2", world_size=1, frozen_dtype=frozen_dtype)
        assert row.param_bytes == 4 * trainable_numel + frozen_bytes * frozen_numel
        assert row.grad_bytes == 4 * trainable_numel
        assert row.optimizer_bytes == 2 * 4 * trainable_numel + 4 * tensors  # AdamW's two moments and step
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the estimate converts nothing


def test_the_estimate_refuses_nf4_naming_what_it_counts():
    with pytest.raises(ValueError) as error:
        estimate_module(frozen_backbone_lm(), strategy="fsdp2", world_size=2, frozen_dtype="nf4")
    assert (
        str(error.value) == "`frozen_dtype` must be one of ('bfloat16', 'float16') or None to be estimated; got 'nf4'."
    )


def test_the_estimate_command_takes_the_frozen_dtype(capsys):
    argv = ["estimate", "testkit.frozen:FrozenBaseRegressor", "--world-sizes", "2", "--strategies", "fsdp2", "--json"]
    assert main([*argv, "--frozen-dtype", "bfloat16"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    model = FrozenBaseRegressor()
    assert row == estimate_module(model, strategy="fsdp2", world_size=2, frozen_dtype="bfloat16").as_dict()
    assert row["param_bytes"] < estimate_module(model, strategy="fsdp2", world_size=2).param_bytes


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_checkpoint_of_a_bf16_frozen_base_resumes_into_a_module_built_in_fp32(trainer_env, tmp_path, state_dict_type):
    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 3))

    def fit(model: FrozenBaseRegressor, steps: int, ckpt_path: str | None = None) -> L.Trainer:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=FSDP2Strategy(frozen_dtype="bfloat16", state_dict_type=state_dict_type),
            default_root_dir=tmp_path,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            max_steps=steps,
        )
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
        return trainer

    L.seed_everything(0)
    saved = FrozenBaseRegressor()
    checkpoint = fit(saved, 2).checkpoint_callback.best_model_path
    trainer_env.fresh()
    L.seed_everything(1)  # other initial values: the checkpoint's must replace them
    resumed = FrozenBaseRegressor()
    trainer = fit(resumed, 2, ckpt_path=checkpoint)

    assert trainer.global_step == 2  # resumed at the saved step: nothing left to train
    for (name, before), after in zip(saved.named_parameters(), resumed.parameters()):
        assert after.dtype == before.dtype and torch.equal(after, before), name
    assert {p.dtype for p in resumed.base.parameters()} == {torch.bfloat16}


def test_a_frozen_dtensor_is_cast_in_its_local_shard_and_stays_the_same_parameter(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]), requires_grad=False)
    weight, values = layer.weight, layer.weight.full_tensor().clone()
    assert store_frozen(layer, "bfloat16", shards=1) == 1
    assert layer.weight is weight and isinstance(weight, DTensor)  # tied names and optimizer groups stay valid
    assert weight.dtype == weight.to_local().dtype == torch.bfloat16
    assert torch.equal(weight.full_tensor(), values.to(torch.bfloat16))
    assert layer.bias.dtype == torch.float32  # trainable
