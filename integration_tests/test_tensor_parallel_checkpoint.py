"""Checkpoints move between 2 data x 2 tensor ranks (``tensor_parallel_size=2``), 4 data ranks (1-D ``fsdp2``) and
``strategy="ddp"`` on 4 gloo ranks: Distributed Checkpoint reshards the DTensors of either sharded layout into the
other's, and DDP's single ``.ckpt`` file is split into the 2x2 layout's shards, AdamW's state with the weights.

Each layout trains 4 steps and saves at step 2 on the way (the end of the first epoch); each checkpoint is resumed
in another layout to step 4. A resumed run starts from exactly the parameters its checkpoint holds, AdamW's state
comes along (its step count), and it ends where DDP resumed from its own checkpoint ends: DDP is the reference, since
under DDP too a resume from that checkpoint ends ~1e-2 away from the run that saved it and went on. ``consolidate`` turns the 2x2 and the 4x1
checkpoints into the same file, which holds what DDP's file holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_strategy.tools.consolidate import consolidate_checkpoint
from integration_tests.conftest import max_absolute_difference, torchrun

WORKER = "integration_tests.tensor_parallel_checkpoint_worker"
# The layouts differ by reduction order only, which AdamW's first steps at lr 1e-2 (dividing by the square root of
# tiny second moments) turn into up to ~3e-5 after 2 steps (measured: 2x2 3.0e-5, 4x1 2.3e-5 from ddp).
LAYOUT_TOLERANCE = 1e-4
# What a resume may add to the difference its checkpoint starts with (measured: 1e-7).
RESUME_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tensor_parallel_checkpoint")


@pytest.fixture(scope="module")
def results(checkpoints: Path) -> dict:
    runs = {
        "2x2": ["--layout", "2x2", "--save", str(checkpoints / "2x2.ckpt")],
        "4x1": ["--layout", "4x1", "--save", str(checkpoints / "4x1.ckpt")],
        "ddp": ["--layout", "ddp", "--save", str(checkpoints / "ddp.ckpt")],
        "4x1 from 2x2": ["--layout", "4x1", "--resume", str(checkpoints / "2x2.ckpt")],
        "2x2 from 4x1": ["--layout", "2x2", "--resume", str(checkpoints / "4x1.ckpt")],
        "2x2 from ddp": ["--layout", "2x2", "--resume", str(checkpoints / "ddp.ckpt")],
        "ddp from ddp": ["--layout", "ddp", "--resume", str(checkpoints / "ddp.ckpt")],
    }
    found = {}
    for index, (name, args) in enumerate(runs.items()):
        out = checkpoints / f"result_{index}.pt"
        torchrun(WORKER, [*args, "--steps", "4", "--out", str(out)], nproc=4, cwd=checkpoints)
        found[name] = torch.load(out)
    return found


def test_every_layout_trains_as_ddp(results: dict) -> None:
    for layout in ("2x2", "4x1"):
        assert max_absolute_difference(results[layout]["saved"], results["ddp"]["saved"]) <= LAYOUT_TOLERANCE
        assert max_absolute_difference(results[layout]["params"], results["ddp"]["params"]) <= LAYOUT_TOLERANCE


@pytest.mark.parametrize(
    ("resumed", "saved"), [("4x1 from 2x2", "2x2"), ("2x2 from 4x1", "4x1"), ("2x2 from ddp", "ddp")]
)
def test_a_checkpoint_resumes_in_another_layout_to_the_parameters_of_ddps_resume(
    results: dict, resumed: str, saved: str
) -> None:
    assert max_absolute_difference(results[resumed]["at_start"], results[saved]["saved"]) <= 1e-7
    assert results[resumed]["adam_steps"] == {4.0}
    assert results[resumed]["global_step"] == 4
    # It ends where DDP's own resume ends, but for the difference the saved checkpoint held from DDP's.
    held = max_absolute_difference(results[saved]["saved"], results["ddp"]["saved"])
    assert (
        max_absolute_difference(results[resumed]["params"], results["ddp from ddp"]["params"])
        <= held + RESUME_TOLERANCE
    )
    assert max_absolute_difference(results[resumed]["params"], results[resumed]["at_start"]) > 1e-3  # it trained


def test_consolidate_gives_the_same_file_from_either_layout_as_ddp_saves(results: dict, checkpoints: Path) -> None:
    files = {
        layout: torch.load(consolidate_checkpoint(checkpoints / f"{layout}.ckpt", checkpoints / f"{layout}.full"))
        for layout in ("2x2", "4x1")
    }
    files["ddp"] = torch.load(checkpoints / "ddp.ckpt")
    # Each holds exactly the whole parameters of its run at the save.
    for layout, file in files.items():
        assert max_absolute_difference(file["state_dict"], results[layout]["saved"]) == 0.0
    for layout in ("2x2", "4x1"):
        ours, ddps = files[layout], files["ddp"]
        assert max_absolute_difference(ours["state_dict"], ddps["state_dict"]) <= LAYOUT_TOLERANCE
        assert ours["global_step"] == ddps["global_step"] == 2
        (optimizer,), (ddp_optimizer,) = ours["optimizer_states"], ddps["optimizer_states"]
        assert optimizer["param_groups"] == ddp_optimizer["param_groups"]
        assert optimizer["state"].keys() == ddp_optimizer["state"].keys()
        for index, entries in ddp_optimizer["state"].items():
            assert max_absolute_difference(optimizer["state"][index], entries) <= LAYOUT_TOLERANCE
