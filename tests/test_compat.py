"""The private torch names of ``fsdp_strategy._compat`` do what the package relies on, on a real 1-rank gloo group."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from fsdp_strategy._compat import reduce_root_gradients_after


class Critic(nn.Module):
    """A manual training_step in miniature: the root's "forward" computes a loss and runs its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)  # a unit
        self.critic = nn.Linear(4, 1)  # the root's own

    def step(self, *, hooked: bool) -> None:
        features = self.block(torch.ones(2, 4)).detach()  # no unit's output reaches the loss
        loss = self.critic(features).pow(2).sum()
        if hooked:
            reduce_root_gradients_after(self, loss)
        loss.backward()


def critic_gradient(mesh, *, hooked: bool) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Critic()
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    register_fsdp_forward_method(model, "step")
    model.step(hooked=hooked)
    model.reshard()
    return model.critic.weight.grad


def test_a_loss_from_the_roots_own_parameters_reduces_their_gradients(mesh) -> None:
    assert critic_gradient(mesh, hooked=False) is None  # FSDP2 alone: left in the unsharded parameter
    reduced = critic_gradient(mesh, hooked=True)
    assert isinstance(reduced, DTensor) and reduced.full_tensor().abs().sum() > 0


def test_the_units_plan_is_read_on_this_torch_and_on_those_before_2_12(mesh) -> None:
    from fsdp_strategy._compat import _param_groups, sharded_units

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    fully_shard([model[0], model[1]], mesh=mesh, reshard_after_forward=False)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    units = sharded_units(model)
    assert [(members, reshards) for members, reshards in units] == [([model[0], model[1]], False), ([model[2]], True)]

    class Before212:  # FSDPState up to torch 2.11: one group or None, under the singular name
        def __init__(self, group: object) -> None:
            self._fsdp_param_group = group

    group = object()
    assert _param_groups(Before212(group)) == [group]
    assert _param_groups(Before212(None)) == []


def bf16_model(mesh) -> nn.Sequential:  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def test_unsharded_parameters_are_made_without_gathering_and_are_the_ones_fsdp2_gathers_into(mesh) -> None:
    from fsdp_strategy._compat import unsharded_parameters

    model = bf16_model(mesh)
    sharded = dict(model[0].named_parameters())
    made = unsharded_parameters(model[0])
    assert made is not None and set(made) == {id(p) for p in sharded.values()}
    # Storage freed, as after a reshard: nothing of the unit's full size stays allocated.
    assert all(p.untyped_storage().size() == 0 for p in made.values())

    model[0].unshard()
    for name, gathered in model[0].named_parameters():
        assert gathered is made[id(sharded[name])]  # the same Parameter FSDP2 gathers into, and keeps
        assert gathered.dtype == torch.bfloat16 and gathered.requires_grad
        assert torch.equal(gathered, sharded[name].full_tensor().to(torch.bfloat16))
    model[0].reshard()

    reference = bf16_model(mesh)  # never through unsharded_parameters: the same gradients
    for module in (model, reference):
        module(torch.ones(2, 4)).sum().backward()
    for (name, grad), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(grad.grad.full_tensor(), expected.grad.full_tensor()), name


def test_unsharded_parameters_leave_a_module_fully_shard_did_not_touch_to_a_real_gather(mesh) -> None:
    from fsdp_strategy._compat import unsharded_parameters

    assert unsharded_parameters(nn.Linear(2, 2)) is None
