"""The distributed Adafactor steps (fsdp_strategy/optim/adafactor.py) on a real 1-rank gloo mesh: a ``fully_shard``-ed
module against torch's and transformers' own optimizers on a plain copy, every option, 1-D to 4-D parameters, the
state's keys and global shapes, a resume from whole entries, and the refusal of a tensor-parallel layout."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers.optimization import Adafactor as HFAdafactor

from fsdp_strategy.checkpoint.optimizer_state import full_state, load_full_state
from fsdp_strategy.optim import ShardedOptimizers, adafactor
from fsdp_strategy.optim.rows import UnsupportedLayout
from testkit.collectives import CollectiveCounter

TOLERANCE = 1e-6


class Tiny(nn.Module):
    """A matrix, a one-row matrix (its column statistics have the parameter's shape), a 3-D and a 4-D parameter,
    vectors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 7)
        self.head = nn.Linear(7, 1)
        self.conv = nn.Conv2d(2, 3, 3)
        self.cube = nn.Parameter(torch.randn(3, 4, 5))
        self.scale = nn.Parameter(torch.randn(6))


def _pair(mesh) -> tuple[nn.Module, nn.Module]:
    plain = Tiny()
    sharded = copy.deepcopy(plain)
    fully_shard(sharded, mesh=mesh)
    return plain, sharded


def _groups(model: nn.Module, options: dict) -> list[dict]:
    # Two groups, so that both go through the same two collectives.
    params = list(model.parameters())
    return [{"params": params[:3]}, {"params": params[3:], **options.pop("second", {})}]


def _set_grads(plain: nn.Module, sharded: nn.Module, seed: int, skip: str | None = None) -> None:
    generator = torch.Generator().manual_seed(seed)
    for (name, p), s in zip(plain.named_parameters(), sharded.parameters()):
        if name == skip:
            p.grad, s.grad = None, None
            continue
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        s.grad = distribute_tensor(p.grad.clone(), s.device_mesh, s.placements, src_data_rank=None)


def _whole(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _relative(a, b) -> float:
    a, b = torch.as_tensor(_whole(a), dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if b.numel() else 0.0


def _max_difference(plain, sharded, reference, distributed) -> float:
    worst = max(_relative(s, p) for p, s in zip(plain.parameters(), sharded.parameters()))
    for p, s in zip(plain.parameters(), sharded.parameters()):
        expected, got = reference.state.get(p, {}), distributed.state.get(s, {})
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert tuple(_whole(got[key]).shape) == tuple(value.shape), key
                worst = max(worst, _relative(got[key], value))
            else:
                assert got[key] == value, key
    return worst


def _train(mesh, make, step, options: dict, steps: int = 4, skip: str | None = None, resume_at: int | None = None):
    plain, sharded = _pair(mesh)
    reference = make(_groups(plain, dict(options)), **{k: v for k, v in options.items() if k != "second"})
    distributed = make(_groups(sharded, dict(options)), **{k: v for k, v in options.items() if k != "second"})
    for i in range(steps):
        if i == resume_at:  # as a full checkpoint loads: entries of the parameter's shape sharded, the rest whole
            saved = full_state(distributed, keep=True)
            distributed.state.clear()
            load_full_state(distributed, saved)
        _set_grads(plain, sharded, seed=i, skip=skip)
        reference.step()
        step(distributed)
    return plain, sharded, reference, distributed


TORCH_OPTIONS = {
    "default": {},
    "eps1": {"eps": (1e-10, 1e-3)},
    "maximize": {"maximize": True},
    "weight_decay": {"weight_decay": 0.1, "second": {"weight_decay": 0.3}},
    "tensor_lr": {"lr": torch.tensor(0.05)},
    "beta2_decay_and_d": {"beta2_decay": -0.5, "d": 2.0, "lr": 0.2},
    "foreach": {"foreach": True, "weight_decay": 0.01},
}


@pytest.mark.parametrize("name", TORCH_OPTIONS)
def test_torch_adafactor_equals_its_own_step_on_whole_parameters(mesh, name):
    plain, sharded, reference, distributed = _train(
        mesh, torch.optim.Adafactor, adafactor.torch_step, TORCH_OPTIONS[name]
    )
    assert _max_difference(plain, sharded, reference, distributed) < TOLERANCE


HF_OPTIONS = {
    "relative_step": {},
    "warmup_init": {"warmup_init": True},
    "lr": {"lr": 1e-2, "relative_step": False},
    "no_scale": {"lr": 1e-2, "relative_step": False, "scale_parameter": False},
    "beta1": {"beta1": 0.9, "weight_decay": 0.1},
    "clip_decay_eps": {"clip_threshold": 0.5, "decay_rate": -0.5, "eps": (1e-20, 1e-2), "second": {"beta1": 0.5}},
}


@pytest.mark.parametrize("name", HF_OPTIONS)
def test_transformers_adafactor_equals_its_own_step_on_whole_parameters(mesh, name):
    plain, sharded, reference, distributed = _train(mesh, HFAdafactor, adafactor.transformers_step, HF_OPTIONS[name])
    assert _max_difference(plain, sharded, reference, distributed) < TOLERANCE


def test_state_keeps_the_optimizers_keys_and_global_shapes(mesh):
    _, sharded, _, distributed = _train(mesh, torch.optim.Adafactor, adafactor.torch_step, {}, steps=1)
    linear, head, cube, scale = sharded.linear.weight, sharded.head.weight, sharded.cube, sharded.scale
    state = distributed.state
    assert state[linear]["step"].shape == () and state[linear]["step"].dtype == torch.float32
    assert isinstance(state[linear]["row_var"], DTensor) and state[linear]["row_var"].shape == (7, 1)
    # A matrix's column statistics are whole on every rank; a cube's are split by its leading dim.
    assert not isinstance(state[linear]["col_var"], DTensor) and state[linear]["col_var"].shape == (1, 8)
    assert not isinstance(state[head]["col_var"], DTensor) and state[head]["col_var"].shape == (1, 7)
    assert isinstance(state[cube]["col_var"], DTensor) and state[cube]["col_var"].shape == (3, 1, 5)
    assert state[cube]["row_var"].shape == (3, 4, 1)
    assert set(state[scale]) == {"step", "variance"} and state[scale]["variance"].placements == (Shard(0),)

    _, sharded, _, distributed = _train(mesh, HFAdafactor, adafactor.transformers_step, {"beta1": 0.9}, steps=1)
    state = distributed.state
    linear, cube, conv, scale = sharded.linear.weight, sharded.cube, sharded.conv.weight, sharded.scale
    assert set(state[linear]) == {"step", "exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "RMS"}
    assert state[linear]["step"] == 1 and state[linear]["RMS"].shape == ()
    assert state[linear]["exp_avg"].shape == (7, 8) and isinstance(state[linear]["exp_avg"], DTensor)
    assert isinstance(state[linear]["exp_avg_sq_row"], DTensor) and state[linear]["exp_avg_sq_row"].shape == (7,)
    assert not isinstance(state[linear]["exp_avg_sq_col"], DTensor) and state[linear]["exp_avg_sq_col"].shape == (8,)
    assert state[cube]["exp_avg_sq_row"].shape == (3, 4) and state[cube]["exp_avg_sq_col"].shape == (3, 5)
    assert state[conv]["exp_avg_sq_row"].shape == (3, 2, 3) and isinstance(state[conv]["exp_avg_sq_col"], DTensor)
    assert set(state[scale]) == {"step", "exp_avg", "exp_avg_sq", "RMS"}


def test_a_parameter_without_gradient_is_skipped(mesh):
    for make, step in ((torch.optim.Adafactor, adafactor.torch_step), (HFAdafactor, adafactor.transformers_step)):
        plain, sharded, reference, distributed = _train(mesh, make, step, {}, skip="cube")
        assert sharded.cube not in distributed.state
        assert torch.equal(sharded.cube.full_tensor(), plain.cube)
        assert _max_difference(plain, sharded, reference, distributed) < TOLERANCE


@pytest.mark.parametrize("which", ["torch", "transformers"])
def test_resuming_from_whole_entries_equals_an_uninterrupted_run(mesh, which):
    make, step = (torch.optim.Adafactor, adafactor.torch_step)
    if which == "transformers":
        make, step = HFAdafactor, adafactor.transformers_step
    plain, sharded, reference, distributed = _train(mesh, make, step, {"weight_decay": 0.1}, steps=4, resume_at=2)
    assert _max_difference(plain, sharded, reference, distributed) < TOLERANCE
    # Entries are back in their own layout: split ones DTensors, a one-row matrix's column statistics whole.
    assert all(isinstance(v, DTensor) for k, v in distributed.state[sharded.linear.weight].items() if "row" in k)
    column = "col_var" if which == "torch" else "exp_avg_sq_col"
    assert not isinstance(distributed.state[sharded.head.weight][column], DTensor)


def test_a_one_row_matrix_loads_its_column_statistics_sharded_and_gets_them_whole_without_a_gather(mesh):
    _, sharded, _, distributed = _train(mesh, torch.optim.Adafactor, adafactor.torch_step, {}, steps=1)
    load_full_state(distributed, full_state(distributed, keep=True))
    head = sharded.head.weight
    assert isinstance(distributed.state[head]["col_var"], DTensor)  # shaped like its parameter: sharded like it
    head.grad = torch.ones_like(head)
    with CollectiveCounter() as counter:
        adafactor.torch_step(distributed)
    assert [c.kind for c in counter.records] == ["all_reduce", "all_reduce"]  # summed whole in the first one
    assert not isinstance(distributed.state[head]["col_var"], DTensor)


def test_the_closure_runs_with_gradients_and_its_loss_is_returned(mesh):
    _, sharded = _pair(mesh)
    weight = sharded.linear.weight
    for optimizer in (torch.optim.Adafactor([weight]), HFAdafactor([weight])):
        ShardedOptimizers().adopt([optimizer])  # the installed step runs the closure, then the distributed step

        def closure():
            assert torch.is_grad_enabled()
            weight.grad = torch.ones_like(weight)
            return torch.tensor(3.0)

        with torch.no_grad():
            assert optimizer.step(closure).item() == 3.0
        assert "step" in optimizer.state[weight]


def test_transformers_bf16_parameters_step_in_fp32_as_transformers_does(mesh):
    plain, sharded = _pair(mesh)
    plain, sharded = plain.to(torch.bfloat16), sharded.to(torch.bfloat16)
    reference, distributed = HFAdafactor(plain.parameters()), HFAdafactor(sharded.parameters())
    for i in range(3):
        _set_grads(plain, sharded, seed=i)
        reference.step()
        adafactor.transformers_step(distributed)
    for p, s in zip(plain.parameters(), sharded.parameters()):
        assert s.dtype == torch.bfloat16 and torch.equal(s.full_tensor(), p)
        assert all(v.dtype == torch.float32 for v in distributed.state[s].values() if isinstance(v, torch.Tensor))


def test_a_tensor_parallel_layout_is_refused_before_training(mesh):
    split = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    expected = (
        "{name} runs distributed on parameters sharded by rows over one mesh dimension (FSDP2's own layout, also"
        f" under hybrid sharding); this one is laid out as (Shard(dim=1),) on {mesh}, as tensor parallelism splits"
        " it. Use `tensor_parallel_size=1` with {name}, or an elementwise optimizer (AdamW, SGD) for the split"
        " parameters."
    )
    for check, make, name in (
        (adafactor.check_torch, torch.optim.Adafactor, "torch.optim.Adafactor"),
        (adafactor.check_transformers, HFAdafactor, "transformers.optimization.Adafactor"),
    ):
        with pytest.raises(UnsupportedLayout, match=re.escape(expected.format(name=name))):
            check(make([split]))
