"""Parameters without a gradient (``fsdp_strategy.step.unused``) on a real 1-rank gloo group.

On one rank "unused here" is "unused on every rank", so each such gradient must come back as it was
before the backward, as DDP with ``find_unused_parameters=True`` leaves it; the 2-rank comparison with
DDP is in ``integration_tests/test_dropin.py``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fsdp_strategy  # noqa: F401  (registers the strategy names)
from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.step.unused import UnusedParameters, supported
from testkit.dropin import TinyMoE, token_loader


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.left = nn.Linear(4, 1)
        self.right = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, side: str) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (self.left if side == "left" else self.right)(x)


def sharded_branchy(mesh) -> Branchy:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Branchy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def backward(model: Branchy, tracker: UnusedParameters, side: str, *, sync: bool = True) -> None:
    model.set_requires_gradient_sync(sync)
    tracker.before_backward()
    model(torch.ones(2, 4), side).sum().backward()
    if sync:
        tracker.after_backward()


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


needs_zeros = pytest.mark.skipif(
    not supported(), reason="torch < 2.13 cannot reduce-scatter zeros for unused parameters"
)


def test_a_parameter_no_rank_used_keeps_no_gradient(mesh) -> None:
    model = sharded_branchy(mesh)
    tracker = UnusedParameters(model)
    for _ in range(2):  # the unsharded parameters that the hooks sit on are reused from step to step
        backward(model, tracker, "left")
        got = grads(model)
        assert got["right.weight"] is None and got["right.bias"] is None
        used = ("left.weight", "left.bias", "blocks.0.weight", "blocks.1.bias")
        assert all(isinstance(got[name], DTensor) for name in used)
        model.zero_grad()


@needs_zeros
def test_the_tracker_asks_for_zeros_and_takes_back_those_no_rank_needed(mesh) -> None:
    # The tracker turns on FSDP2's zeros for unused parameters (so that the ranks' reduce-scatters have the same size),
    # and after the backward it puts back the gradients that no rank used: zeros would move them under AdamW.
    model = sharded_branchy(mesh)
    tracker = UnusedParameters(model)
    tracker.before_backward()
    model(torch.ones(2, 4), "left").sum().backward()
    zeros = model.right.weight.grad
    assert zeros is not None and not zeros.full_tensor().any()  # reduced as zeros: the tracker asked for them
    tracker.after_backward()
    assert model.right.weight.grad is None and model.right.bias.grad is None
    assert model.left.weight.grad is not None


def test_an_existing_gradient_of_an_unused_parameter_is_left_as_it_was(mesh) -> None:
    # zero_grad(set_to_none=False) keeps zero tensors; DDP leaves those alone too.
    model = sharded_branchy(mesh)
    tracker = UnusedParameters(model)
    backward(model, tracker, "right")
    model.zero_grad(set_to_none=False)
    backward(model, tracker, "left")
    right = model.right.weight.grad
    assert right is not None and not right.full_tensor().any()


def test_use_in_any_micro_batch_since_the_last_reduction_counts(mesh) -> None:
    model = sharded_branchy(mesh)
    tracker = UnusedParameters(model)
    backward(model, tracker, "right", sync=False)  # accumulated locally, not reduced
    backward(model, tracker, "left")
    got = grads(model)
    assert got["right.weight"] is not None and got["left.weight"] is not None
    model.zero_grad()
    backward(model, tracker, "left")  # a new window: right is unused again
    assert model.right.weight.grad is None


def test_close_removes_the_hooks_and_the_zero_filling(mesh) -> None:
    model = sharded_branchy(mesh)
    tracker = UnusedParameters(model)
    tracker.close()
    model(torch.ones(2, 4), "left").sum().backward()
    assert model.right.weight.grad is None  # FSDP2 alone: no zeros to reduce
    assert not any(tracker._used)


def test_registry_names_the_ddp_option() -> None:
    entry = StrategyRegistry["fsdp2_find_unused_parameters_true"]
    assert entry["strategy"] is FSDP2Strategy and entry["init_params"] == {}


def test_idle_experts_in_a_trainer_get_no_gradient_and_no_update(trainer_env) -> None:
    # Expert 3 gets tokens in the first two batches only; AdamW's weight decay would move it on zeros.
    L.seed_everything(0)
    model = TinyMoE("adamw")
    seen: list[dict[str, bool]] = []

    class Grads(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
            seen.append({name: p.grad is not None for name, p in pl_module.named_parameters() if ".experts." in name})

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="fsdp2",
        max_steps=4,
        limit_val_batches=0,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Grads()],
    )
    trainer.fit(model, token_loader("moe", rank=0, batch_size=2, batches=4))

    # Rank 0's data never route a token to expert 2.
    def expert_params(*experts: int) -> list[str]:
        layers = [f"{layer}.{kind}" for layer in ("up", "down") for kind in ("weight", "bias")]
        return [f"blocks.{block}.experts.{e}.{layer}" for block in (0, 1) for e in experts for layer in layers]

    assert sorted(name for name, has in seen[0].items() if not has) == sorted(expert_params(2))
    assert sorted(name for name, has in seen[3].items() if not has) == sorted(expert_params(2, 3))


# torch 2.15 reduces a unit whose parameters got gradients in different micro-batches under mixed precision.
reduces_mixed_dtypes = torch.__version__ >= "2.15"


@needs_zeros
def test_mixed_precision_accumulation_names_the_option_that_works(trainer_env) -> None:
    # Before torch 2.15, FSDP2 keeps earlier micro-batches' gradients in fp32 and zeros for idle expert 2 in bf16.
    def fit(**options) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
        L.seed_everything(0)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=FSDP2Strategy(**options),
            precision="bf16-mixed",
            max_steps=2,
            accumulate_grad_batches=2,
            limit_val_batches=0,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = TinyMoE()
        trainer.fit(model, token_loader("moe", rank=0, batch_size=2, batches=4))
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    if reduces_mixed_dtypes:
        accumulated = fit()
    else:
        with pytest.raises(AssertionError, match="uniform gradient dtype") as failure:
            fit()
        assert "Pass `sync_grads_each_micro_batch=True` to FSDP2Strategy" in "\n".join(failure.value.__notes__)
    trainer_env.fresh()
    synced = fit(sync_grads_each_micro_batch=True)
    if reduces_mixed_dtypes:
        L.seed_everything(0)
        initial = dict(TinyMoE().named_parameters())
        assert any(not torch.equal(initial[name], value) for name, value in accumulated.items())
        # The two reduce the same bf16 gradients in a different order.
        for name, value in synced.items():
            torch.testing.assert_close(accumulated[name], value, rtol=2e-2, atol=2e-3, msg=name)
