"""LiveTensors: bytes of live tensor storages counted op by op, without the allocator."""

from __future__ import annotations

import torch

from fsdp_strategy._compat import FakeTensorMode
from fsdp_strategy.estimator.live_tensors import LiveTensors, existing_tensors


def test_outputs_count_once_per_storage_until_freed():
    with LiveTensors() as live:
        a = torch.ones(250)  # 1000 bytes
        view = a.view(25, 10)  # same storage: not counted again
        b = a * 2  # 1000 bytes more
        assert live.current == 2000
        del b
        assert live.current == 1000 and live.peak == 2000
        del a, view
        assert live.current == 0 and live.peak == 2000


def test_tensors_from_before_count_once_tracked_and_resized_storages_count_at_their_size():
    # FSDP2 frees a gathered parameter by resizing its storage to zero and re-allocates it the same way;
    # UntypedStorage.resize_ bypasses the dispatcher.
    before = torch.empty(0)
    original = torch.UntypedStorage.resize_
    with LiveTensors() as live:
        live.track(t for t in existing_tensors() if t is before)
        assert live.current == 0
        before.untyped_storage().resize_(4096)
        assert live.current == 4096
        before.untyped_storage().resize_(0)
        assert live.current == 0 and live.peak == 4096
    assert torch.UntypedStorage.resize_ is original  # watched only while a tracker is entered


def test_existing_tensors_finds_tensors_without_naming_their_owner():
    held = {"deep": [torch.zeros(3)]}
    found = existing_tensors()
    assert any(t is held["deep"][0] for t in found)


def test_fake_tensors_count_only_when_asked():
    with FakeTensorMode():
        with LiveTensors() as real_only:
            torch.empty(100)
        with LiveTensors(fake=True) as fakes:
            kept = torch.empty(100)
    assert real_only.peak == 0
    assert fakes.peak == fakes.current == kept.untyped_storage().nbytes() == 400


def test_a_device_filter_counts_only_that_devices_tensors():
    with LiveTensors(device="cuda") as gpu_only, LiveTensors(device="cpu") as host:
        kept = torch.ones(100)
    assert gpu_only.peak == 0 and host.peak == kept.untyped_storage().nbytes()
