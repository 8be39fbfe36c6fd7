"""The process-group fixtures themselves: a real gloo world of one, and no sharing of a group."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist


def test_single_rank_group_is_a_real_gloo_world_of_one(single_rank_group):
    assert dist.get_backend() == "gloo"
    assert dist.get_world_size() == 1
    assert dist.get_rank() == 0
    tensor = torch.tensor([3.0])
    dist.all_reduce(tensor)
    assert tensor.item() == 3.0


REFUSAL = "A default process group already exists before this test started; an earlier test leaked it."


def test_trainer_env_refuses_to_start_over_an_existing_group(single_rank_group, request):
    with pytest.raises(RuntimeError, match=re.escape(REFUSAL)):
        request.getfixturevalue("trainer_env")
    assert dist.is_initialized()  # the refusal left the existing group alone


def test_single_rank_group_refuses_to_start_over_an_existing_group(request):
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=re.escape(REFUSAL)):
            request.getfixturevalue("single_rank_group")
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
