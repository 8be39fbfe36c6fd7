"""Adapter checkpoints and the PEFT export of a LoRA run on 2 CPU ranks and on 4 (LoRA matrices of rank 3: uneven
shards, one rank empty), against references: a resume from the adapter checkpoint starts and ends exactly where a
resume from a sharded checkpoint of the same run does; the adapter checkpoint holds the LoRA matrices only; and
the exported folder, loaded by ``PeftModel.from_pretrained`` in one process, gives the trained module's logits. On
2 data x 2 tensor ranks (``tensor_parallel_size=2``: the Llama split by its ``base_model_tp_plan``, each LoRA layer's
base and one of its matrices with it) the same holds, and the runs reach the parameters and logits of the 1-D run
on 2 ranks, which reads the same batches.

``integration_tests/adapter_worker.py`` runs the training and the resumes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_strategy.checkpoint.dcp_metadata import read_dcp_metadata
from fsdp_strategy.checkpoint.storage import checkpoint_files
from integration_tests.conftest import REPO, _environment, max_absolute_difference, torchrun
from testkit.hf import save_tiny_llama

pytest.importorskip("peft")


# (processes, tensor_parallel_size) of each layout.
LAYOUTS = {"2ranks": (2, 1), "4ranks": (4, 1), "2x2": (4, 2)}


def run(tmp_path: Path, nproc: int, tensor_parallel_size: int) -> tuple[dict, Path]:
    base = save_tiny_llama(str(tmp_path / "base"))
    out = tmp_path / "results.pt"
    args = ["--base", base, "--root", str(tmp_path), "--out", str(out)]
    args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    torchrun("integration_tests.adapter_worker", args, nproc=nproc, cwd=tmp_path)
    return torch.load(out), tmp_path


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):
    """Each layout's job, run once in this module."""
    done: dict[str, tuple[dict, Path]] = {}

    def job_of(layout: str) -> tuple[dict, Path]:
        if layout not in done:
            done[layout] = run(tmp_path_factory.mktemp(f"adapter{layout}"), *LAYOUTS[layout])
        return done[layout]

    return job_of


@pytest.fixture(scope="module", params=list(LAYOUTS))
def job(request: pytest.FixtureRequest, jobs) -> tuple[dict, Path]:
    return jobs(request.param)


def assert_equal(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys() and theirs
    for name, value in theirs.items():
        if isinstance(value, dict):
            assert_equal(mine[name], value)
        else:
            assert torch.equal(mine[name], value), name


def test_a_resume_from_the_adapter_checkpoint_is_a_resume_from_a_sharded_one(job: tuple[dict, Path]) -> None:
    results, _ = job
    assert_equal(results["adapter/trained"], results["sharded/trained"])  # the same run, saved two ways
    assert_equal(results["adapter/start"]["params"], results["sharded/start"]["params"])
    assert_equal(results["adapter/start"]["optimizer"], results["sharded/start"]["optimizer"])
    assert len(results["adapter/start"]["optimizer"]) == 8  # A and B of q_proj and v_proj in 2 layers
    assert_equal(results["adapter/resumed"], results["sharded/resumed"])


def test_the_adapter_checkpoint_leaves_out_the_frozen_base(job: tuple[dict, Path]) -> None:
    results, root = job
    saved = lambda kind: {  # noqa: E731
        key.removeprefix("model.")
        for key in read_dcp_metadata(checkpoint_files(root / f"{kind}.ckpt")).state_dict_metadata
        if key.startswith("model.")
    }
    assert sorted(saved("adapter")) == results["trainable"]  # the LoRA matrices; the tiny Llama has no buffers saved
    assert set(results["trainable"]) < saved("sharded")
    # On disk, the sharded checkpoint holds the base's bytes besides (and an index entry for each of its tensors).
    assert results["sharded/bytes"] - results["adapter/bytes"] >= results["frozen_bytes"]


def test_the_exported_adapter_loads_with_peft_to_the_runs_logits(job: tuple[dict, Path]) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    results, root = job
    out = root / "exported"
    command = [sys.executable, "-m", "fsdp_strategy", "consolidate", "--format", "peft", "--no-progress"]
    done = subprocess.run(
        [*command, str(root / "adapter.ckpt"), str(out)],
        cwd=REPO,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the peft adapter 'default', 8 tensors" in done.stdout
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(root / "base"), out).eval()
    with torch.no_grad():
        logits = model(input_ids=results["tokens"]).logits
    torch.testing.assert_close(logits, results["logits"], rtol=1e-6, atol=1e-6)


def test_split_over_tensor_parallel_ranks_the_lora_run_is_the_one_dimensional_run(jobs) -> None:
    (split, _), (reference, _) = jobs("2x2"), jobs("2ranks")
    assert split["split"] and not reference["split"]
    # The attention projections peft wrapped: their base layers and LoRA B matrices (colwise, as q_proj and v_proj).
    assert "model.base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight" in split["split"]
    assert "model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in split["split"]
    assert "model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" not in split["split"]
    for run in ("adapter/trained", "sharded/trained", "adapter/resumed", "sharded/resumed"):
        assert max_absolute_difference(split[run], reference[run]) <= 1e-5, run  # as test_tensor_parallel's Llama
    torch.testing.assert_close(split["logits"], reference["logits"], rtol=1e-6, atol=1e-6)
