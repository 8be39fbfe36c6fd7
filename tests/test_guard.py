"""``nonfinite_grads``: detection on a real 1-rank gloo group, the option's errors, and the guard in a Trainer."""

from __future__ import annotations

import re
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.options import check_nonfinite_grads_option
from fsdp_strategy.plugins.precision import FSDP2MixedPrecision
from fsdp_strategy.step.guard import (
    NonFinite,
    NonFiniteGradientError,
    NonFiniteGuard,
    first_nonfinite,
    guard_gradients,
    named_optimizer_params,
)
from testkit.callbacks import DropGradsAt
from testkit.models import PoisonedLM, token_loader

BAD_VALUES = [float("nan"), float("inf"), float("-inf")]


def grad_with(value: float, at: int = 2) -> torch.Tensor:
    grad = torch.ones(4)
    grad[at] = value
    return grad


# --- detection ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_first_nonfinite_finds_nan_and_both_infinities(single_rank_group, bad: float) -> None:
    named = [("a", torch.ones(4)), ("b.c", grad_with(bad)), ("d", None), ("e", grad_with(bad, at=0))]
    assert first_nonfinite(named) == NonFinite(index=1, name="b.c", count=2, total=4)


def test_first_nonfinite_follows_the_given_order(single_rank_group) -> None:
    named = [("z.last", grad_with(float("inf"))), ("a.first", torch.ones(4)), ("m", grad_with(float("nan")))]
    assert first_nonfinite(named) == NonFinite(index=0, name="z.last", count=2, total=3)
    assert first_nonfinite(named[1:]) == NonFinite(index=1, name="m", count=1, total=2)


def test_finite_none_and_empty_gradients_pass(single_rank_group) -> None:
    assert first_nonfinite([("a", torch.full((3,), 1e30)), ("b", None), ("c", torch.empty(0))]) is None
    assert first_nonfinite([("a", None)]) is None
    assert first_nonfinite([]) is None


def test_dtensor_gradients_are_read_through_their_local_shard(mesh) -> None:
    bad = distribute_tensor(grad_with(float("nan")).reshape(2, 2), mesh, [Shard(0)])
    good = distribute_tensor(torch.ones(2, 2), mesh, [Shard(0)])
    assert isinstance(bad, DTensor)
    assert first_nonfinite([("w", good), ("v", bad)]) == NonFinite(index=1, name="v", count=1, total=2)


def test_optimizer_parameters_are_named_in_module_order() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, bias=False))
    model[1].weight = model[0].weight  # tied: named once, by its first name
    outsider = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([{"params": [model[0].bias, outsider]}, {"params": [model[0].weight]}], lr=0.1)
    names = [name for name, _ in named_optimizer_params(model, optimizer)]
    assert names == ["0.weight", "0.bias", "<optimizer parameter 1>"]


# --- the option ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            None,
            TypeError,
            "`nonfinite_grads` must be one of 'ignore', 'skip', 'raise' (a str); got None of type NoneType.",
        ),
        (True, TypeError, "`nonfinite_grads` must be one of 'ignore', 'skip', 'raise' (a str); got True of type bool."),
        ("warn", ValueError, "`nonfinite_grads` must be one of 'ignore', 'skip', 'raise'; got 'warn'."),
        ("Skip", ValueError, "`nonfinite_grads` must be one of 'ignore', 'skip', 'raise'; got 'Skip'."),
    ],
)
def test_bad_option_values_are_refused_by_the_strategy(value, error, message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        FSDP2Strategy(nonfinite_grads=value)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        check_nonfinite_grads_option(value)


def test_default_is_ignore_and_nothing_is_wrapped() -> None:
    strategy = FSDP2Strategy()
    assert strategy.guard.mode == "ignore" and not strategy.guard.active
    assert strategy.skipped_steps == 0


# --- skip and raise on sharded gradients ----------------------------------------------------------


def sharded_model_with_grads(mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(2):  # one real step, so that AdamW has state, then the gradients of the next one
        optimizer.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        if not optimizer.state:
            optimizer.step()
    return model, optimizer


def poison(param: nn.Parameter) -> None:
    param.grad.to_local().view(-1)[0] = float("nan")  # type: ignore[union-attr]


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().full_tensor().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v.full_tensor().clone() if isinstance(v, DTensor) else v.clone() for v in state.values()]
    return tensors


def test_skip_drops_the_gradients_and_adamw_changes_nothing(mesh) -> None:
    model, optimizer = sharded_model_with_grads(mesh)
    poison(model[2].bias)
    before = snapshot(model, optimizer)
    with pytest.warns(UserWarning) as warned:
        assert guard_gradients("skip", named_optimizer_params(model, optimizer), step=7) is True
    assert [str(w.message) for w in warned] == [
        "Skipped the optimizer step at global step 7: the gradients of 1 of 4 parameters hold NaN or inf, the first"
        " being `2.bias`. No parameter or optimizer state changed in this step (`nonfinite_grads='skip'`)."
    ]
    assert all(p.grad is None for p in model.parameters())
    optimizer.step()
    after = snapshot(model, optimizer)
    assert len(after) == len(before) == 4 + 3 * 4  # parameters, then step, exp_avg, exp_avg_sq of each
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_finite_gradients_are_kept(mesh) -> None:
    model, optimizer = sharded_model_with_grads(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert guard_gradients("skip", named_optimizer_params(model, optimizer), step=0) is False
    assert all(p.grad is not None for p in model.parameters())


def test_raise_names_the_first_parameter_the_step_and_the_count(mesh) -> None:
    model, optimizer = sharded_model_with_grads(mesh)
    poison(model[2].bias)
    poison(model[0].weight)
    message = (
        "Non-finite gradient at global step 12: the gradients of 2 of 4 parameters hold NaN or inf, the first being"
        " `0.weight`. Training stopped on every rank (`nonfinite_grads='raise'`). HINT: look for NaN or inf in that"
        " step's loss and inputs, lower the learning rate or clip gradients (`Trainer(gradient_clip_val=...)`), or"
        " pass `nonfinite_grads='skip'` to skip such steps with a warning."
    )
    with pytest.raises(NonFiniteGradientError, match=f"^{re.escape(message)}$") as raised:
        guard_gradients("raise", named_optimizer_params(model, optimizer), step=12)
    assert isinstance(raised.value, FloatingPointError)
    assert all(p.grad is not None for p in model.parameters())


def test_the_guard_counts_skipped_steps(mesh) -> None:
    model, optimizer = sharded_model_with_grads(mesh)
    guard = NonFiniteGuard("skip")
    poison(model[0].bias)
    with pytest.warns(UserWarning, match="global step 5"):
        assert guard.wrap(lambda: "loss", model, optimizer, step=5, device=torch.device("cpu"), scaler=None)() == "loss"
    assert guard.skipped_steps == 1 and model[0].bias.grad is None


# --- in a Trainer (one process) -------------------------------------------------------------------


def fit(model: L.LightningModule, *, precision="32-true", plugins=None, callbacks=(), max_steps=4, **strategy_options):
    strategy = FSDP2Strategy(**strategy_options)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision=precision if plugins is None else None,
        plugins=plugins,
        max_steps=max_steps,
        # Lightning allows neither with manual optimization.
        accumulate_grad_batches=2 if model.automatic_optimization else 1,
        gradient_clip_val=0.5 if model.automatic_optimization else None,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(model, token_loader())
    return trainer


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def test_skip_in_a_trainer_ends_where_a_run_that_drops_that_step_ends(trainer_env) -> None:
    # Gradient accumulation and norm clipping on; the reference has no guard and no poison.
    L.seed_everything(0)
    poisoned = PoisonedLM(poison_step=2)
    with pytest.warns(UserWarning, match=re.escape("Skipped the optimizer step at global step 2")) as warned:
        trainer = fit(poisoned, nonfinite_grads="skip")
    assert trainer.strategy.skipped_steps == 1
    assert len([w for w in warned if "Skipped the optimizer step" in str(w.message)]) == 1
    adamw_steps = {int(s["step"]) for s in trainer.optimizers[0].state.values()}
    assert adamw_steps == {3}  # 4 steps, one skipped

    trainer_env.fresh()
    L.seed_everything(0)
    reference = PoisonedLM(poison_step=None)
    fit(reference, callbacks=[DropGradsAt(2)])
    expected = full_params(reference)
    assert all(torch.equal(value, expected[name]) for name, value in full_params(poisoned).items())


class ManualLM(PoisonedLM):
    """Manual optimization; ``drop_step`` zeroes the gradients by hand instead of poisoning them."""

    def __init__(self, poison_step: int | None, drop_step: int | None = None) -> None:
        super().__init__(poison_step)
        self.drop_step = drop_step
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = self.poisoned(self.loss(batch))
        optimizer.zero_grad()
        self.manual_backward(loss)
        if self.global_step == self.drop_step:
            optimizer.zero_grad()
        optimizer.step()
        return loss


def test_skip_under_manual_optimization(trainer_env) -> None:
    L.seed_everything(0)
    poisoned = ManualLM(poison_step=1)
    with pytest.warns(UserWarning, match=re.escape("Skipped the optimizer step at global step 1")):
        trainer = fit(poisoned, nonfinite_grads="skip", max_steps=3)
    assert trainer.strategy.skipped_steps == 1

    trainer_env.fresh()
    L.seed_everything(0)
    reference = ManualLM(poison_step=None, drop_step=1)
    fit(reference, max_steps=3)
    expected = full_params(reference)
    assert all(torch.equal(value, expected[name]) for name, value in full_params(poisoned).items())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true"])
def test_raise_under_each_precision(trainer_env, precision: str) -> None:
    expected = "Non-finite gradient at global step 1: the gradients of 1 of 31 parameters hold NaN or inf, the first being `scale`."
    with pytest.raises(NonFiniteGradientError, match=re.escape(expected)):
        # SGD: AdamW's eps underflows in fp16 ("16-true") and yields non-finite updates of its own.
        fit(PoisonedLM(poison_step=1, optimizer="sgd"), precision=precision, nonfinite_grads="raise")


def test_the_16_mixed_gradient_scaler_handles_nonfinite_steps_itself(trainer_env) -> None:
    # Lightning turns precision="16-mixed" on CPU into bf16; the plugin is given directly to get the scaler.
    plugin = FSDP2MixedPrecision("16-mixed", "cpu")
    scale = plugin.scaler.get_scale()  # type: ignore[union-attr]
    trainer = fit(PoisonedLM(poison_step=1), plugins=[plugin], nonfinite_grads="raise")
    assert trainer.strategy.skipped_steps == 0
    assert plugin.scaler.get_scale() < scale  # type: ignore[union-attr]
