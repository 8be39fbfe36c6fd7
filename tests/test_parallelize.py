"""Planning units, sharding them on a real 1-rank mesh, activation checkpointing, meta materialization."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

from fsdp_strategy.sharding.mixed_precision import (
    FULL_PRECISION_POLICY,
    mixed_precision_policy,
)
from fsdp_strategy.sharding.parallelize import (
    apply_activation_checkpointing,
    apply_fully_shard,
    load_full_tensors_into_shards,
    plan_units,
)
from fsdp_strategy.sharding.policy import normalize_policy
from fsdp_strategy.step import unused
from fsdp_strategy.step.unused import UnusedParameters
from testkit import full
from testkit.models import Block, TinyGAN, TinyLM, token_loader

FP32 = MixedPrecisionPolicy()
BF16 = mixed_precision_policy("bf16-mixed")


def auto():
    return normalize_policy("auto", option="wrap_policy")


def batch():
    return next(iter(token_loader(batch_size=2, samples=2)))


def shard(model: nn.Module, mesh, policy="auto", mp_policy=FP32, keep_norms_fp32=False):
    """plan_units + apply_fully_shard, as the strategy runs them; ``policy`` in any user form."""
    policy = normalize_policy(policy, option="wrap_policy")
    units = plan_units(model, policy, mp_policy=mp_policy, keep_norms_fp32=keep_norms_fp32)
    apply_fully_shard(
        model, units, mesh, root_mp_policy=mp_policy, offload_policy=OffloadPolicy(), reshard_after_forward=True
    )
    return units


# --- plan_units ----------------------------------------------------------------------------------------


def test_plan_under_mixed_precision_has_one_fp32_norm_group_the_blocks_and_the_rest():
    model = TinyLM()
    units = plan_units(model, auto(), mp_policy=BF16, keep_norms_fp32=True)
    norms = tuple(name for name, module in model.named_modules() if isinstance(module, nn.LayerNorm))
    blocks = [(f"blocks.{i}",) for i in reversed(range(len(model.blocks)))]
    # the norms first: they sit inside the blocks, and fully_shard must see inner units first
    assert [unit.names for unit in units] == [norms, *blocks, ("embed", "head")]
    assert [unit.mp_policy for unit in units] == [FULL_PRECISION_POLICY, *[BF16] * len(blocks), BF16]
    # the groups stay gathered from forward to backward; blocks follow the strategy's setting
    assert [unit.reshard_after_forward for unit in units] == [False, *[None] * len(blocks), False]


def test_unit_parameter_counts_exclude_nested_units_and_leave_the_root_its_own_parameters():
    model = TinyLM()
    units = plan_units(model, auto(), mp_policy=BF16, keep_norms_fp32=True)
    by_name = {unit.name: unit.num_params for unit in units}
    block = model.blocks[0]
    assert by_name["blocks.0"] == sum(p.numel() for p in block.parameters()) - sum(
        p.numel() for p in block.norm.parameters()
    )
    assert by_name["embed, head"] == model.embed.weight.numel()  # the tied weight, once
    assert sum(by_name.values()) + model.scale.numel() == sum(p.numel() for p in model.parameters())


def test_plan_without_mixed_precision_has_the_blocks_then_everything_else_as_one_group():
    model = TinyLM()
    units = plan_units(model, auto(), mp_policy=FP32, keep_norms_fp32=False)
    names = [unit.name for unit in units]
    assert names == [f"blocks.{i}" for i in reversed(range(len(model.blocks)))] + ["embed, norm, head"]
    assert all(unit.mp_policy is FP32 for unit in units)


def test_tied_embedding_and_head_are_never_units_of_their_own_even_when_selected():
    model = TinyLM()
    policy = normalize_policy({nn.Embedding, nn.Linear, Block}, option="wrap_policy")
    units = plan_units(model, policy, mp_policy=FP32, keep_norms_fp32=False)
    assert [unit.names for unit in units if "embed" in unit.names] == [("embed", "norm", "head")]
    assert "blocks.0.attn_q" in [unit.name for unit in units]  # untied Linears are still selected


def test_a_module_sharing_parameters_with_the_root_itself_stays_in_the_root():
    model = TinyLM()
    model.norm.weight = model.scale  # the root's own parameter
    units = plan_units(model, auto(), mp_policy=FP32, keep_norms_fp32=False)
    assert units[-1].names == ("embed", "head")


def test_units_are_planned_post_order_with_their_own_parameter_counts():
    model = TinyGAN()
    policy = normalize_policy(lambda name, module: name in ("generator", "generator.0"), option="wrap_policy")
    units = plan_units(model, policy, mp_policy=FP32, keep_norms_fp32=False)
    assert [unit.name for unit in units] == ["generator.0", "generator", "discriminator"]
    generator = {unit.name: unit.num_params for unit in units}["generator"]
    assert generator == sum(p.numel() for p in model.generator[2].parameters())


def test_no_wrap_policy_plans_one_group_below_the_root_and_the_fp32_norms():
    model = TinyLM()
    assert [unit.names for unit in plan_units(model, None, mp_policy=FP32, keep_norms_fp32=False)] == [
        ("embed", "blocks", "norm", "head")
    ]
    norms, rest = plan_units(model, None, mp_policy=BF16, keep_norms_fp32=True)
    assert norms.modules and all(isinstance(module, nn.LayerNorm) for module in norms.modules)
    # the outermost modules that hold no norm: the blocks' layers one by one
    assert rest.names[:2] == ("embed", "blocks.0.attn_q") and rest.names[-1] == "head"
    assert not any(isinstance(m, nn.LayerNorm) for module in rest.modules for m in module.modules())
    assert norms.num_params + rest.num_params + model.scale.numel() == sum(p.numel() for p in model.parameters())


def test_modules_the_user_already_sharded_are_left_alone(mesh):
    model = TinyLM()
    fully_shard(model.blocks[0], mesh=mesh)
    units = plan_units(model, auto(), mp_policy=BF16, keep_norms_fp32=True)
    names = [unit.name for unit in units]
    assert not [name for name in names if name == "blocks.0" or name.startswith("blocks.0.")]
    assert "blocks.1" in names and any("blocks.1.norm" in unit.names for unit in units)
    apply_fully_shard(
        model, units, mesh, root_mp_policy=BF16, offload_policy=OffloadPolicy(), reshard_after_forward=True
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the bf16-mixed precision plugin runs it
        loss = model.training_step(batch(), 0)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


# --- apply_fully_shard -------------------------------------------------------------------------------


def test_fully_shard_turns_units_and_root_into_fsdp_modules_with_dtensor_params(mesh):
    model = TinyLM()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    units = shard(model, mesh)
    assert isinstance(model, FSDPModule)
    assert all(isinstance(module, FSDPModule) for unit in units for module in unit.modules)
    assert isinstance(model.blocks[0], Block)  # still the user's class underneath
    assert isinstance(model.embed, FSDPModule) and isinstance(model.head, FSDPModule)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.device_mesh == mesh
        assert param.placements == (Shard(0),)
        assert torch.equal(full(param), before[name])
    assert model.head.weight is model.embed.weight  # tying survives sharding


def test_sharded_training_step_runs_forward_and_backward(mesh):
    torch.manual_seed(0)
    reference = TinyLM()
    model = TinyLM()
    model.load_state_dict(reference.state_dict())
    shard(model, mesh)
    loss = model.training_step(batch(), 0)
    loss.backward()
    expected = reference.loss(batch())
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(param.grad, DTensor), name
        torch.testing.assert_close(full(param.grad), ref.grad, msg=name)


class RootParameterModule(L.LightningModule):
    """Its training_step uses a root-owned parameter before calling forward()."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((4,), 2.0))
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch * self.gain).sum()


def test_step_methods_defined_by_the_user_are_routed_through_fsdp(mesh):
    model = RootParameterModule()
    shard(model, mesh, policy=["Linear"])
    assert "training_step" in vars(model)  # registered as an FSDP forward method
    assert "validation_step" not in vars(model)  # LightningModule's default is left alone
    tracker = UnusedParameters(model)
    tracker.before_backward()
    loss = model.training_step(torch.ones(2, 4), 0)  # gain is a sharded DTensor outside forward() otherwise
    loss.backward()
    if not unused.supported():  # torch < 2.13 reduced the root when forward's input got its gradient, before gain's
        with pytest.raises(
            RuntimeError, match=r"^The gradients of 'gain' arrived after their unit's gradients were reduced"
        ):
            tracker.after_backward()
        return
    tracker.after_backward()
    assert isinstance(model.gain.grad, DTensor)
    assert torch.equal(full(model.gain.grad), full(model.proj.weight).sum(0) * 2)


# --- activation checkpointing ----------------------------------------------------------------------


def test_activation_checkpointing_keeps_keys_and_gradients_and_recomputes_forward():
    torch.manual_seed(0)
    plain = TinyLM()
    checkpointed = TinyLM()
    checkpointed.load_state_dict(plain.state_dict())
    blocks = [(f"blocks.{i}", block) for i, block in enumerate(checkpointed.blocks)]
    apply_activation_checkpointing(blocks)

    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert all(type(block) is Block for block in checkpointed.blocks)

    calls = {"plain": 0, "checkpointed": 0}
    # attn_q, not the last layer: non-reentrant recomputation stops once every saved tensor is back.
    plain.blocks[0].attn_q.register_forward_hook(lambda *_: calls.__setitem__("plain", calls["plain"] + 1))
    checkpointed.blocks[0].attn_q.register_forward_hook(
        lambda *_: calls.__setitem__("checkpointed", calls["checkpointed"] + 1)
    )
    plain.loss(batch()).backward()
    checkpointed.loss(batch()).backward()

    assert calls == {"plain": 1, "checkpointed": 2}  # recomputed once in backward
    for (name, ref), param in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(param.grad, ref.grad), name


def test_a_sharded_module_loads_a_plain_full_state_dict_as_under_ddp(mesh):
    torch.manual_seed(0)
    source = TinyLM()
    model = TinyLM()
    shard(model, mesh)
    handles = load_full_tensors_into_shards(model)
    state = source.state_dict()
    before = {k: v.clone() for k, v in state.items()}

    model.blocks[0].load_state_dict(
        {k.removeprefix("blocks.0."): v for k, v in state.items() if k.startswith("blocks.0.")}
    )
    model.load_state_dict(state)

    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and torch.equal(full(param), state[name]), name
    assert all(
        torch.equal(state[k], before[k]) and not isinstance(state[k], DTensor) for k in state
    )  # caller's dict untouched
    for handle in handles:
        handle.remove()
    try:
        model.load_state_dict(state)
    except RuntimeError as error:  # without the hooks: FSDP2's own refusal
        assert "DTensor" in str(error)
    else:
        raise AssertionError("a plain state dict loaded into DTensor parameters without the hooks")
