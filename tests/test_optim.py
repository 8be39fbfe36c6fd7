"""The optimizer layer on one real gloo rank: which class is which kind, the refusals and their messages, the
distributed steps' pieces (rows, owners, the local step) against torch's own optimizers on plain tensors, and user
code in ``training_step`` that reads whole parameters (``step/whole_reads.py``)."""

from __future__ import annotations

import contextlib
import copy
import re

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.optim import OptimizerKind, ShardedOptimizers, classify
from fsdp_strategy.optim.install import DISTRIBUTED
from fsdp_strategy.optim.kinds import UnsupportedOptimizerError, class_path
from fsdp_strategy.optim.owners import apply_whole
from fsdp_strategy.optim.rows import RowShards, UnsupportedLayout, row_shards
from fsdp_strategy.step.whole_reads import WholeReads, plain_tensors
from testkit.optimizers import Regression, regression_loader


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(3, 2))]


class Lamb(torch.optim.Optimizer):
    """A per-tensor trust ratio, as LAMB's: the norm of the whole parameter."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * float(p.norm() / p.grad.norm().clamp_min(1e-12)))


class QuietAdamW(torch.optim.AdamW):
    """Only other defaults: it steps as AdamW."""

    def __init__(self, params):
        super().__init__(params, lr=1e-4)


class ClippedSGD(torch.optim.SGD):
    """Its own step: unknown, whatever its base."""

    def step(self, closure=None):
        return super().step(closure)


def test_each_class_of_torch_optim_has_its_kind():
    kinds = {}
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "ASGD"):
        kinds[name] = classify(getattr(torch.optim, name)(_params(), lr=0.1), distributed=DISTRIBUTED, declared=())
    assert set(kinds.values()) == {OptimizerKind.ELEMENTWISE}
    for name in ("Muon", "Adafactor", "Rprop"):
        optimizer = getattr(torch.optim, name)(_params())
        assert classify(optimizer, distributed=DISTRIBUTED, declared=()) == OptimizerKind.DISTRIBUTED, name
    assert class_path(torch.optim.AdamW) == "torch.optim.AdamW"


def test_a_subclass_that_keeps_its_bases_step_is_elementwise_one_with_its_own_is_refused_unless_declared():
    assert classify(QuietAdamW(_params()), distributed=DISTRIBUTED, declared=()) == OptimizerKind.ELEMENTWISE
    with pytest.raises(UnsupportedOptimizerError, match="`test_optim.ClippedSGD` is not an optimizer"):
        classify(ClippedSGD(_params(), lr=0.1), distributed=DISTRIBUTED, declared=())
    for declared in (["ClippedSGD"], ["test_optim.ClippedSGD"]):
        kind = classify(ClippedSGD(_params(), lr=0.1), distributed=DISTRIBUTED, declared=declared)
        assert kind == OptimizerKind.ELEMENTWISE


UNKNOWN = (
    "`test_optim.Lamb` is not an optimizer this strategy knows to step shards as DDP steps whole parameters: under"
    " FSDP2 each rank steps only its shard of every parameter, so an update that reads more than each element alone"
    " (a norm of the whole parameter or update, a trust ratio, a matrix function, a factored statistic) would"
    " silently train differently from DDP. If its update reads each element alone, as Adam's and SGD's do, declare"
    ' it: `FSDP2Strategy(elementwise_optimizers=["Lamb"])`. Otherwise train it with `strategy="ddp"`, or use one of'
    " the optimizers that run distributed: `torch.optim.Adafactor`, `torch.optim.Muon`,"
    " `transformers.optimization.Adafactor`."
)


def test_an_unknown_optimizer_is_refused_before_the_first_step(trainer_env, tmp_path):
    class WithLamb(Regression):
        def configure_optimizers(self):
            return Lamb(self.parameters())

    model = WithLamb("adafactor")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="fsdp2", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(UnsupportedOptimizerError) as raised:
        trainer.fit(model, regression_loader())
    assert str(raised.value) == UNKNOWN
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("Lamb", TypeError, "`elementwise_optimizers` must be a list of optimizer class names"),
        (["Lamb", ""], ValueError, "which holds ''"),
        ([3], ValueError, "which holds 3"),
    ],
)
def test_elementwise_optimizers_option_is_checked(value, error, message):
    with pytest.raises(error, match=re.escape(message)):
        FSDP2Strategy(elementwise_optimizers=value)


def test_rows_are_cut_as_torch_chunk_cuts_them():
    layout = RowShards(rows=6, group=None, rank=0, size=4)
    assert [layout.rows_of(r) for r in range(4)] == [2, 2, 2, 0]
    assert [layout.start_of(r) for r in range(4)] == [0, 2, 4, 6]
    assert [RowShards(rows=30, group=None, rank=0, size=4).rows_of(r) for r in range(4)] == [8, 8, 8, 6]


def test_a_tensor_parallel_layout_is_refused_naming_the_fix(mesh):
    split = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])
    with pytest.raises(UnsupportedLayout, match=re.escape("Use `tensor_parallel_size=1` with torch.optim.Muon")):
        row_shards(split, optimizer="torch.optim.Muon")


def _sharded_pair(mesh):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    sharded = fully_shard(copy.deepcopy(plain), mesh=mesh)
    return plain, sharded


def _step(model, optimizer, steps=3):
    for i in range(steps):
        inputs = torch.randn(4, 5, generator=torch.Generator().manual_seed(i))
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Rprop(ps, lr=0.01),
        lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2], lr=0.05, adjust_lr_fn="match_rms_adamw"),
    ],
    ids=["rprop", "muon"],
)
def test_the_distributed_steps_equal_torchs_on_plain_parameters(mesh, make):
    plain, sharded = _sharded_pair(mesh)
    reference, optimizer = make(list(plain.parameters())), make(list(sharded.parameters()))
    steps = ShardedOptimizers()
    steps.adopt([optimizer])
    _step(plain, reference)
    _step(sharded, optimizer)
    for (name, mine), theirs in zip(sharded.named_parameters(), plain.parameters()):
        assert torch.equal(mine.full_tensor(), theirs.detach()), name
    for mine, theirs in zip(optimizer.state.values(), reference.state.values()):
        for key, value in theirs.items():
            got = mine[key].full_tensor() if isinstance(mine[key], DTensor) else mine[key]
            assert torch.equal(got, value), key
    steps.release()
    assert "step" not in optimizer.__dict__  # the optimizer's own step again


def test_the_installed_step_keeps_the_optimizers_step_hooks_and_its_lr_scheduler_quiet(mesh, recwarn):
    _, sharded = _sharded_pair(mesh)
    optimizer = torch.optim.Muon([p for p in sharded.parameters() if p.ndim == 2])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    seen = []
    optimizer.register_step_post_hook(lambda *_: seen.append("post"))
    ShardedOptimizers().adopt([optimizer])
    _step(sharded, optimizer, steps=1)
    scheduler.step()
    assert seen == ["post"]
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]


def test_owners_compute_each_whole_matrix(mesh):
    whole = torch.randn(5, 3)
    local = distribute_tensor(whole, mesh, [Shard(0)])
    layout = row_shards(local, optimizer="test")
    (result,) = apply_whole([local.to_local()], [layout], lambda m: m @ m.T @ m)
    assert torch.equal(result, whole @ whole.T @ whole)


def test_a_penalty_on_sharded_weights_gets_the_gradient_of_the_whole_weights(mesh):
    plain, sharded = _sharded_pair(mesh)
    inputs = torch.randn(4, 5)
    for model, reads in ((plain, None), (sharded, WholeReads())):
        loss = model(inputs).pow(2).mean()
        with reads or torch.enable_grad():
            total = plain_tensors(loss + 0.1 * sum(p.pow(2).sum() for p in model.parameters()))
        assert type(total) is torch.Tensor
        total.backward()
    for mine, theirs in zip(sharded.parameters(), plain.parameters()):
        assert torch.allclose(mine.grad.full_tensor(), theirs.grad, rtol=1e-6, atol=1e-7)


def test_a_reduction_of_shards_is_the_whole_value_on_every_rank(mesh):
    # DTensor's own result is each rank's part (Partial): its item() would be this rank's part alone.
    plain, sharded = _sharded_pair(mesh)
    with WholeReads():
        square_sum = sharded[0].weight.pow(2).sum()
        mean, std = torch.std_mean(sharded[2].weight)
    assert square_sum.placements == (Replicate(),)  # whole on every rank; a shard divided by it stays a shard
    assert square_sum.item() == pytest.approx(plain[0].weight.pow(2).sum().item(), rel=1e-6)
    assert (mean.item(), std.item()) == pytest.approx(tuple(t.item() for t in torch.std_mean(plain[2].weight)))


def test_gradients_clipped_in_training_step_are_clipped_as_the_whole_gradients(mesh):
    # clip_grad_norm_ multiplies the shards by a plain coefficient in one in-place foreach op: dropping its result
    # would leave the gradients unclipped without a word.
    plain, sharded = _sharded_pair(mesh)
    inputs = torch.randn(4, 5)
    norms = []
    for model, reads in ((plain, None), (sharded, WholeReads())):
        model(inputs).pow(2).sum().backward()
        with reads or torch.enable_grad():
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1))
            torch._foreach_add_([p.grad for p in model.parameters()], [torch.ones(p.shape) for p in plain.parameters()])
    assert norms[1].placements == (Replicate(),) and norms[1].item() == pytest.approx(norms[0].item(), rel=1e-6)
    for mine, theirs in zip(sharded.parameters(), plain.parameters()):
        assert torch.allclose(mine.grad.full_tensor(), theirs.grad, rtol=1e-6, atol=1e-7)


def test_reductions_that_dtensor_averages_or_returns_several_of_are_whole(mesh):
    plain, sharded = _sharded_pair(mesh)
    values, grads = [], []
    for model, reads in ((plain, None), (sharded, WholeReads())):
        weight = model[0].weight
        with reads or torch.enable_grad():
            # DTensor averages the ranks' means for a loss whose target is a shard too.
            anchored = nn.functional.mse_loss(weight, torch.zeros_like(weight))
            low, high = torch.aminmax(model[2].weight)
            norms = torch._foreach_norm([p for p in model.parameters()])
        assert not any(isinstance(v, DTensor) and v.placements[0].is_partial() for v in (anchored, low, high, *norms))
        anchored.backward()
        values.append([float(v) for v in (anchored, low, high, *norms)])
        grads.append(weight.grad.full_tensor() if isinstance(weight.grad, DTensor) else weight.grad)
    assert values[1] == pytest.approx(values[0], rel=1e-6)
    assert torch.allclose(grads[1], grads[0], rtol=1e-6, atol=1e-8)


def test_an_item_assigned_into_a_shard_is_written(mesh):
    plain, sharded = _sharded_pair(mesh)
    with torch.no_grad():
        plain[0].weight[0] = 0.0
        plain[2].bias[1:] = torch.tensor([2.0, 3.0])
        with WholeReads():
            sharded[0].weight[0] = 0.0
            sharded[2].bias[1:] = torch.tensor([2.0, 3.0])
    for mine, theirs in zip(sharded.parameters(), plain.parameters()):
        assert torch.equal(mine.full_tensor(), theirs)


def test_a_whole_value_assigned_to_data_or_grad_is_laid_out_as_the_shards(mesh):
    plain, sharded = _sharded_pair(mesh)
    with torch.no_grad():
        for model, reads in ((plain, None), (sharded, WholeReads())):
            with reads or contextlib.nullcontext():
                model[0].weight.data = torch.ones(7, 5)
                model[0].bias.data = model[0].bias.data * 0.5
                model[2].weight.grad = torch.full((3, 7), 2.0)
                torch.nn.utils.vector_to_parameters(torch.arange(38.0), model[2].parameters())  # assigns p.data
    for mine, theirs in zip(sharded.parameters(), plain.parameters()):
        assert isinstance(mine, DTensor) and torch.equal(mine.full_tensor(), theirs)
    assert torch.equal(sharded[2].weight.grad.full_tensor(), plain[2].weight.grad)
    with WholeReads(), pytest.raises(RuntimeError) as raised:
        sharded[0].weight.data = torch.ones(3, 3)
    assert str(raised.value) == (
        "`p.data = value` of a sharded parameter of shape (7, 5) and torch.float32 got a value of shape (3, 3) and"
        " torch.float32: under FSDP2 only a value of the parameter's own shape and dtype can be laid out as its"
        " shards. Build the model with that shape (in `configure_model`)."
    )


def test_an_op_without_a_sharding_rule_runs_on_the_whole_parameter_and_writes_the_shards(mesh):
    plain, sharded = _sharded_pair(mesh)
    with torch.no_grad():
        plain[0].weight.copy_(torch.renorm(plain[0].weight, 2, 0, 0.5))
        plain[2].weight.clamp_(-0.1, 0.1)
        with WholeReads():
            sharded[0].weight.copy_(torch.renorm(sharded[0].weight, 2, 0, 0.5))
            sharded[2].weight.clamp_(torch.tensor(-0.1), torch.tensor(0.1))
    for mine, theirs in zip(sharded.parameters(), plain.parameters()):
        assert isinstance(mine, DTensor)
        assert torch.equal(mine.full_tensor(), theirs)


def test_a_constraint_outside_training_step_fails_at_its_first_call_naming_the_fix(trainer_env, tmp_path):
    class RenormAfterEachBatch(Regression):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            with torch.no_grad():
                self.net[0].weight.copy_(torch.renorm(self.net[0].weight, 2, 0, 1.0))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="fsdp2", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="aten.renorm.default does not have a sharding strategy") as raised:
        trainer.fit(RenormAfterEachBatch("torch.optim.AdamW"), regression_loader())
    assert trainer.global_step == 1
    (note,) = [n for n in raised.value.__notes__ if "sharded parameter" in n]
    assert note.endswith(
        "Move the code into `training_step`, or, for gradients and parameters before the step, into"
        " `on_before_optimizer_step` (whole under `hook_view='whole'`), or compute on `p.full_tensor()` and write"
        " the result back with `p.copy_(distribute_tensor(result, p.device_mesh, p.placements))`."
    )
