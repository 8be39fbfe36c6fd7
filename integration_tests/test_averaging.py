"""Lightning's WeightAveraging (EMA) under FSDP2 against the same callback under DDP, on 2 CPU ranks."""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp_strategy import consolidate_checkpoint
from integration_tests.conftest import launch, max_relative_difference


def assert_close(results: dict, run: str, reference: str) -> None:
    ours, ref = results[run], results[reference]
    assert max_relative_difference(ours["params"], ref["params"]) <= 1e-5, run
    assert len(ours["averages"]) == len(ref["averages"]), run
    for step, (average, expected) in enumerate(zip(ours["averages"], ref["averages"])):
        assert max_relative_difference(average, expected) <= 1e-5, f"{run}: the average after step {step}"
    # The validation ran on the average, swapped in and out as under DDP.
    torch.testing.assert_close(ours["val_losses"], ref["val_losses"], rtol=1e-5, atol=0)


def test_weight_averaging_matches_ddp_sharded_saved_resumed_and_consolidated(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    results = launch(
        ["--checkpoint-dir", str(directory)], tmp_path, nproc=2, module="integration_tests.averaging_worker"
    )
    ema, swa = results["ema"], results["swa"]

    # 8 steps: the module, the average after every step and the validation losses are DDP's.
    for run in ("fsdp2", "fsdp2_full"):
        assert_close(ema, run, "ddp")
        assert_close(swa, run, "ddp")
    # Resumed from the step-4 checkpoint (sharded, single file, and DDP's own file) to step 8: as DDP resumed.
    for run in ("fsdp2>fsdp2", "fsdp2_full>fsdp2_full", "ddp>fsdp2"):
        assert_close(ema, run, "ddp>ddp")
        assert len(ema[run]["averages"]) == 4, "the resumed run must continue from step 4"

    # Each rank holds half of every averaged parameter, laid out as the module's, and never gathers it.
    for run in ("fsdp2", "fsdp2>fsdp2"):
        layout = ema[run]["layout"]
        assert layout and all(p["dtensor"] and p["same_placements"] for p in layout.values()), layout
        assert sum(p["local_numel"] for p in layout.values()) * 2 == sum(p["numel"] for p in layout.values())
        assert ema[run]["collectives"] == 0

    # The checkpoints hold what DDP's hold: the average as "state_dict", the module as "current_model_state".
    ddp = torch.load(directory / "ddp" / "step=4.ckpt", weights_only=True)
    consolidated = consolidate_checkpoint(
        directory / "fsdp2" / "step=4.ckpt", tmp_path / "consolidated.ckpt", progress=False
    )
    for path in (consolidated, directory / "fsdp2_full" / "step=4.ckpt"):
        ours = torch.load(path, weights_only=True)
        assert ours.keys() == ddp.keys(), path
        for key in ("state_dict", "current_model_state"):
            assert max_relative_difference(ours[key], ddp[key]) <= 1e-5, (path, key)
        assert ours["averaging_state"] == ddp["averaging_state"] == {"n_averaged": torch.tensor(4)}
