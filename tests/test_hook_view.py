"""The hooks that read gradients see whole parameters and gradients (``fsdp_strategy.sharding.hook_view``), on a real 1-rank
gloo group; the 2- and 4-rank comparison with DDP is in ``integration_tests/test_finetuning.py``."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.sharding.hook_view import WholeParameters, hooks_read_parameters, whole_parameters_in_hooks
from testkit import full
from testkit.models import TinyLM, token_loader


def sharded_pair(mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 4)).sum().backward()
    return model


def test_the_hooks_see_plain_whole_tensors_and_the_shards_take_what_they_changed(mesh):
    model = sharded_pair(mesh)
    grads = {name: None if p.grad is None else full(p.grad).clone() for name, p in model.named_parameters()}
    view = WholeParameters(model)
    view.open()
    seen = dict(model.named_parameters())
    assert not any(isinstance(p, DTensor) for p in seen.values())
    assert seen["0.weight"].grad is None and not seen["0.weight"].requires_grad  # frozen: no gradient, as under DDP
    assert torch.equal(seen["1.weight"].grad, grads["1.weight"])
    seen["1.weight"].grad.mul_(0.5)  # in place
    seen["1.bias"].grad = torch.full_like(seen["1.bias"], 3.0)  # replaced
    seen["0.bias"].grad = None  # dropped
    with torch.no_grad():
        seen["1.bias"].fill_(-1.0)  # a parameter's value
    view.close()
    after = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in after.values())
    assert torch.equal(full(after["1.weight"].grad), grads["1.weight"] * 0.5)
    assert torch.equal(full(after["1.bias"].grad), torch.full((2,), 3.0))
    assert after["0.bias"].grad is None
    assert torch.equal(full(after["1.bias"]), torch.full((2,), -1.0))
    view.close()  # closing twice changes nothing


class GradNormLM(TinyLM):
    def on_before_optimizer_step(self, optimizer) -> None:  # type: ignore[no-untyped-def]
        self.log_dict(grad_norm(self, norm_type=2))


def fit(model: L.LightningModule, **options) -> L.Trainer:  # type: ignore[no-untyped-def]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(**options),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, token_loader(samples=8))
    return trainer


def test_who_reads_parameters_in_the_hook_is_named():
    class Reader(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
            pass

    assert hooks_read_parameters(TinyLM(), [L.Callback()]) == []
    assert hooks_read_parameters(GradNormLM(), [Reader(), L.Callback()]) == [
        "GradNormLM.on_before_optimizer_step",
        "Reader.on_before_optimizer_step",
    ]

    class Clipping(TinyLM):
        def on_after_backward(self) -> None:
            pass

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):  # type: ignore[no-untyped-def]
            pass

    assert hooks_read_parameters(Clipping(), []) == [
        "Clipping.on_after_backward",
        "Clipping.configure_gradient_clipping",
    ]


def test_only_the_overridden_hooks_gather(mesh):
    model = sharded_pair(mesh)
    view = whole_parameters_in_hooks(model, (GradNormLM(), []), torch.device("cpu"), 1)
    assert view is not None and view.reads("on_before_optimizer_step")
    assert not view.reads("on_after_backward")  # no gather after each backward for the grad_norm recipe
    assert whole_parameters_in_hooks(model, (TinyLM(), [L.Callback()]), torch.device("cpu"), 1) is None


def test_grad_norm_in_the_hook_logs_the_single_device_values(trainer_env):
    torch.manual_seed(0)
    sharded = GradNormLM()
    reference = GradNormLM()
    reference.load_state_dict(sharded.state_dict())
    logged = fit(sharded).callback_metrics
    trainer_env.fresh()
    single = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    single.fit(reference, token_loader(samples=8))
    norms = {k: float(v) for k, v in single.callback_metrics.items() if k.startswith("grad_")}
    assert len(norms) > 1
    for name, value in norms.items():
        assert float(logged[name]) == pytest.approx(value, rel=1e-6), name


def test_under_the_sharded_view_the_error_names_the_whole_view(trainer_env):
    with pytest.raises(RuntimeError, match="its data is not allocated yet") as failure:
        fit(GradNormLM(), hook_view="sharded")
    note = "\n".join(getattr(failure.value, "__notes__", []))
    assert "Pass `hook_view='whole'` to see them whole in the hooks that read gradients, as under DDP" in note
