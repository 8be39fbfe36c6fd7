"""A sharded checkpoint moves between 2 data x 2 tensor ranks (``tensor_parallel_size=2``) and 4 data ranks (1-D
``fsdp2``) on 4 gloo ranks: Distributed Checkpoint reshards the DTensors of either layout into the other's.

Each layout trains 2 steps and saves; each checkpoint is resumed in the other layout for 2 more steps. A resumed
run starts from exactly the parameters its checkpoint holds (those of the run that saved it), AdamW's state comes
along (its step count), and the two crossed resumes end where the same training ends in either layout.
"""

from __future__ import annotations

import pytest
import torch

from integration_tests.conftest import torchrun

WORKER = "integration_tests.tensor_parallel_checkpoint_worker"


def max_absolute_difference(params: dict, reference: dict) -> float:
    assert params.keys() == reference.keys()
    return max((params[k] - reference[k]).abs().max().item() for k in reference)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("tensor_parallel_checkpoint")
    runs = {
        "2x2": ["--layout", "2x2", "--steps", "2", "--save", str(tmp_path / "2x2.ckpt")],
        "4x1": ["--layout", "4x1", "--steps", "2", "--save", str(tmp_path / "4x1.ckpt")],
        "4x1 from 2x2": ["--layout", "4x1", "--steps", "4", "--resume", str(tmp_path / "2x2.ckpt")],
        "2x2 from 4x1": ["--layout", "2x2", "--steps", "4", "--resume", str(tmp_path / "4x1.ckpt")],
    }
    found = {}
    for index, (name, args) in enumerate(runs.items()):
        out = tmp_path / f"result_{index}.pt"
        torchrun(WORKER, [*args, "--out", str(out)], nproc=4, cwd=tmp_path)
        found[name] = torch.load(out)
    return found


@pytest.mark.parametrize(("resumed", "saved"), [("4x1 from 2x2", "2x2"), ("2x2 from 4x1", "4x1")])
def test_a_checkpoint_resumes_in_the_other_layout(results: dict, resumed: str, saved: str) -> None:
    assert max_absolute_difference(results[resumed]["at_start"], results[saved]["params"]) <= 1e-7
    assert results[resumed]["adam_steps"] == {4.0}
    assert results[resumed]["global_step"] == 4


def test_the_crossed_resumes_train_alike(results: dict) -> None:
    # The layouts' first two steps differ by reduction order only (~1e-6 under AdamW at lr 1e-2).
    assert max_absolute_difference(results["4x1"]["params"], results["2x2"]["params"]) <= 1e-5
    assert max_absolute_difference(results["4x1 from 2x2"]["params"], results["2x2 from 4x1"]["params"]) <= 1e-5
    moved = max_absolute_difference(results["4x1 from 2x2"]["params"], results["4x1 from 2x2"]["at_start"])
    assert moved > 1e-3  # the two resumed steps trained
