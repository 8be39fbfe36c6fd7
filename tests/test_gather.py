"""After a stage the module is the one the user built, as DDP leaves it (fsdp_strategy/sharding/unshard.py), on a
real 1-rank group: its classes, its Parameter objects with the trained values, no sharding hooks, and
optimizers that refer to those parameters, across several stages of one Trainer."""

from __future__ import annotations

import io

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_strategy import FSDP2Strategy
from testkit.models import TinyLM, token_loader


def trainer(tmp_path, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=2, **kwargs,
    )  # fmt: skip


class Sharded(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        self.weight = pl_module.blocks[0].attn_q.weight
        self.values = self.weight.full_tensor().clone()


def forward_hooks(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def test_the_module_after_fit_is_the_users_own_with_the_trained_values(trainer_env, tmp_path):
    model = TinyLM()
    weight_before, hooks_before = model.blocks[0].attn_q.weight, forward_hooks(model)
    seen = Sharded()
    run = trainer(tmp_path, max_steps=3, strategy=FSDP2Strategy(state_dict_type="sharded"), callbacks=[seen])
    run.fit(model, token_loader())

    assert isinstance(seen.weight, DTensor)  # sharded while training
    assert type(model) is TinyLM and type(model.blocks[0]) is type(TinyLM().blocks[0])
    assert model.blocks[0].attn_q.weight is weight_before and type(weight_before) is nn.Parameter
    assert torch.equal(weight_before, seen.values)
    assert model.head.weight is model.embed.weight
    assert forward_hooks(model) == hooks_before
    optimizer = run.optimizers[0]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    # The optimizer's states stay sharded (entries shaped like their parameters), gathered only by a save.
    for param, state in optimizer.state.items():
        assert all(isinstance(v, DTensor) and v.shape == param.shape for k, v in state.items() if k != "step")
    torch.save(model, io.BytesIO())

    # Another stage shards it again and gives it back again; fit's optimizer still refers to its parameters.
    run.validate(model, token_loader(), verbose=False)
    assert model.blocks[0].attn_q.weight is weight_before and forward_hooks(model) == hooks_before
    path = tmp_path / "after.ckpt"
    run.save_checkpoint(path)
    trainer_env.fresh()
    resumed = TinyLM()
    trainer(tmp_path, max_steps=3, strategy=FSDP2Strategy(state_dict_type="sharded")).fit(
        resumed, token_loader(), ckpt_path=path
    )
    assert torch.equal(resumed.blocks[0].attn_q.weight, weight_before)  # nothing left to train: 3 steps done
