"""The record of which sharded units ran forward (``fsdp_strategy.step.unit_order``) on a real 1-rank gloo group.

One rank always agrees with itself; what ranks that disagree see is in ``integration_tests/test_dropin.py``.
Here: what the digest covers (which units, how often, in what order; not activation checkpointing's
recomputation in backward), that each check starts a new record, and the error text built from the
records of ranks that disagree.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from fsdp_strategy import UnitMismatchError
from fsdp_strategy.step.unit_order import UnitOrder, describe_mismatch
from fsdp_strategy.step.unused import UnusedParameters
from testkit.dropin import ExpertsLM


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, route: list[int], *, recompute: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        for index in route:
            expert = self.experts[index]
            x = checkpoint(expert, x, use_reentrant=False) if recompute else expert(x)
        return x


def sharded_routed(mesh) -> Routed:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Routed()
    for module in [*model.blocks, *model.experts]:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def digest_after(order: UnitOrder, model: Routed, *routes: list[int]) -> int:
    order.reset()
    with torch.no_grad():
        for route in routes:
            model(torch.ones(2, 4), route)
    return order.fingerprint()[0]


def test_a_model_whose_only_unit_is_the_root_needs_no_record(mesh) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model, mesh=mesh)
    assert UnitOrder.attach(model) is None


def test_the_digest_follows_which_units_ran_how_often_and_in_what_order(mesh) -> None:
    model = sharded_routed(mesh)
    order = UnitOrder(model)
    assert order.names == ["blocks.0", "blocks.1", "experts.0", "experts.1", "experts.2"]  # the root is not a unit here
    assert digest_after(order, model, [0, 1]) == digest_after(order, model, [0, 1])
    runs = (
        [[0, 1]],
        [[1, 0]],
        [[0]],
        [[0, 0]],
        [[0], [1]],
        [[0, 1], []],
        [[2, 1]],
        [[]],
    )  # each forward: blocks, then experts
    assert len({digest_after(order, model, *routes) for routes in runs}) == len(runs)
    assert digest_after(order, model) == 0  # nothing ran


def test_a_check_agrees_with_itself_on_one_rank_and_starts_a_new_record(mesh) -> None:
    model = sharded_routed(mesh)
    order = UnitOrder(model)
    with torch.no_grad():
        model(torch.ones(2, 4), [2])
    assert order.fingerprint()[0] != 0
    order.check(during="validation_step")
    assert order.fingerprint() == [0, 0]


def test_digests_that_differ_between_ranks_raise_and_start_a_new_record(mesh) -> None:
    # What the all-reduce returns when another rank's digest was higher than this one's.
    model = sharded_routed(mesh)
    order = UnitOrder(model)
    with torch.no_grad():
        model(torch.ones(2, 4), [1])
    mine = order.fingerprint()[0]
    with pytest.raises(UnitMismatchError, match=r"Sharded units ran in a different order on different ranks"):
        order.verify([mine + 1, -mine])
    assert order.fingerprint() == [0, 0]


def test_forwards_recomputed_in_backward_are_not_recorded(mesh) -> None:
    model = sharded_routed(mesh)
    order = UnitOrder(model)
    plain = digest_after(order, model, [0, 2])

    def digest_with_recompute(*, bracketed: bool) -> int:
        order.reset()
        loss = model(torch.ones(2, 4, requires_grad=True), [0, 2], recompute=True).sum()
        if bracketed:
            order.before_backward()
        loss.backward()
        order.after_backward()
        return order.fingerprint()[0]

    assert digest_with_recompute(bracketed=True) == plain
    assert digest_with_recompute(bracketed=False) != plain  # the recomputation does run the units' pre-hooks


def test_the_unused_parameter_record_carries_the_digest_and_clears_it(mesh) -> None:
    model = sharded_routed(mesh)
    order = UnitOrder(model)
    tracker = UnusedParameters(model)
    loss = model(torch.ones(2, 4), [1]).sum()
    tracker.before_backward()
    order.before_backward()
    loss.backward()
    order.after_backward()
    assert order.fingerprint()[0] != 0
    tracker.after_backward(order=order)
    assert order.fingerprint() == [0, 0]
    assert model.experts[0].weight.grad is None and model.experts[1].weight.grad is not None


def test_close_removes_the_hooks(mesh) -> None:
    model = sharded_routed(mesh)
    order = UnitOrder(model)
    order.close()
    assert digest_after(order, model, [0, 1]) == 0


def sharded_experts(mesh, *, layer: bool) -> ExpertsLM:  # type: ignore[no-untyped-def]
    model = ExpertsLM(layer=layer)
    experts = model.moe.experts if layer else model.experts
    for module in [*model.blocks, *experts]:  # what wrap_policy="auto" selects
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


AFTER_THE_UNITS = (
    "Each unit's forward all-gathers its parameters, and ranks pair collectives by the order in which they call"
    " them, not by unit: another unit's all-gather stood in for a missing one, so the gradients of this step are"
    " wrong (no optimizer step was taken with them). Every sharded unit must run forward on every rank at every"
    " step, in the same order. "
)
AUTO = (
    ' (wrap_policy="auto" makes a unit of each child of an nn.ModuleList or nn.Sequential that holds two or more'
    " modules of one class; an explicit wrap_policy chooses instead.)"
)


def test_the_error_names_the_units_each_rank_ran_and_the_module_that_routes_to_them(mesh) -> None:
    order = UnitOrder(sharded_experts(mesh, layer=True))
    assert order.names == ["blocks.0", "blocks.1", "moe.experts.0", "moe.experts.1", "moe.experts.2", "moe.experts.3"]
    # Three ranks: expert 2 on rank 0 only, expert 3 twice on ranks 1 and 2.
    per_rank = [([1, 1, 1, 1, 1, 0], [0, 1, 2, 3, 4])] + [([1, 1, 1, 1, 0, 2], [0, 1, 2, 3, 5, 5])] * 2
    assert describe_mismatch(order, per_rank, during="training") == (
        "Sharded units did not run on every rank the same number of times (since the last gradient reduction):\n"
        "  'moe.experts.2' (Expert): once on rank 0, not on ranks 1, 2\n"
        "  'moe.experts.3' (Expert): twice on ranks 1, 2, not on rank 0\n"
        + AFTER_THE_UNITS
        + "Fix: wrap the module that routes to them as the unit, not each of them: wrap_policy=['Block', 'MoEBlock']."
        + AUTO
    )


def test_the_error_for_experts_of_the_root_leaves_them_out_of_the_units(mesh) -> None:
    order = UnitOrder(sharded_experts(mesh, layer=False))
    per_rank = [([1, 1, 1, 0, 1, 1], [0, 1, 2, 4, 5]), ([1, 1, 1, 1, 0, 1], [0, 1, 2, 3, 5])]
    message = describe_mismatch(order, per_rank, during="training")
    assert message.startswith(
        "Sharded units did not run on every rank the same number of times (since the last gradient reduction):\n"
        "  'experts.1' (Expert): once on rank 1, not on rank 0\n"
        "  'experts.2' (Expert): once on rank 0, not on rank 1\n"
    )
    assert message.endswith(
        "Fix: leave them out of the units, so that they are gathered with the rest of the model outside the blocks, once per step on every rank:"
        " wrap_policy=['Block']." + AUTO
    )


def test_the_error_for_the_same_units_in_another_order_names_the_first_difference(mesh) -> None:
    order = UnitOrder(sharded_experts(mesh, layer=True))
    per_rank = [([1, 1, 1, 1, 0, 0], [0, 1, 2, 3]), ([1, 1, 1, 1, 0, 0], [0, 1, 3, 2])]
    message = describe_mismatch(order, per_rank, during="validation_step")
    assert message.startswith(
        "Sharded units ran in a different order on different ranks (in this validation_step):\n"
        "  unit forward number 3: rank 0: 'moe.experts.0', rank 1: 'moe.experts.1'\n"
        "Each unit's forward all-gathers its parameters, and ranks pair collectives by the order in which they call"
        " them, not by unit: another unit's all-gather stood in for a missing one, so the outputs of this"
        " validation_step are wrong."
    )
    assert "wrap_policy=['Block', 'MoEBlock']" in message


def test_a_group_of_modules_is_recorded_once_per_gather_whichever_of_its_modules_run(mesh) -> None:
    # The group gathers when its first module runs and stays gathered until backward frees it: a module of
    # the group that some batches skip (a second head) moves nothing, so it must not enter the record.
    torch.manual_seed(0)
    model = Routed()
    for module in model.blocks:
        fully_shard(module, mesh=mesh)
    fully_shard(list(model.experts), mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    order = UnitOrder(model)
    group = order.names.index("experts.0, experts.1, experts.2")
    one_expert, all_experts = digest_after(order, model, [0]), digest_after(order, model, [0, 1, 2])
    assert one_expert == all_experts and order._counts[group] == 1
    order.reset()
    for route in ([0, 1], [2]):  # each forward and backward gathers the group anew
        model(torch.ones(2, 4), route).sum().backward()
        order.after_backward()
    assert order._counts[group] == 2
