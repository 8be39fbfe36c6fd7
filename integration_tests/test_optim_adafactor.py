"""torch's and transformers' Adafactor run distributed on 1, 2 and 4 ranks and on a 2x2 hybrid mesh, with uneven
shards, equal to their own steps on whole parameters: one 4-rank launch of ``integration_tests/adafactor_worker.py``
(the 1- and 2-rank runs on sub-meshes of it), at most two all-reduces per step for all parameters together."""

from __future__ import annotations

import pytest
import torch

from integration_tests.adafactor_worker import OPTIMIZERS
from integration_tests.conftest import torchrun

TOLERANCE = 1e-6
LAYOUTS = ("1", "2", "4", "2x2")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("adafactor")
    out = workdir / "results.pt"
    torchrun("integration_tests.adafactor_worker", ["--out", str(out)], nproc=4, cwd=workdir, timeout=300)
    return torch.load(out)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_equal_to_the_optimizer_on_whole_parameters_in_two_all_reduces_per_step(results: dict, name, layout):
    result = results[f"{name}/{layout}"]
    assert result["difference"] < TOLERANCE
    assert result["collectives"] == [{"all_reduce": 2}] * 5


@pytest.mark.parametrize("name", ["torch", "hf_options"])
def test_resuming_on_another_world_size_equals_an_uninterrupted_run(results: dict, name):
    result = results[f"{name}/resume_2_to_4"]
    assert result["difference"] < TOLERANCE
    # torch's one-row matrix gets its column statistics back sharded (shaped like the parameter), made whole in
    # the step's first all-reduce.
    assert result["collectives"] == [{"all_reduce": 2}] * 5
