"""A tiny Hugging Face Llama trained under "fsdp2" on 2 ranks, exported with ``fsdp-strategy consolidate
--format safetensors``: the files ``save_pretrained`` writes for the trained model, loadable by ``from_pretrained``.
Trained on 4 ranks as 2 data x 2 tensor (split by its ``base_model_tp_plan``), it exports as the same run on 4 data
ranks does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from integration_tests.conftest import REPO, _environment, max_absolute_difference, torchrun

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# 2x2 and 4x1 differ by reduction order only, which AdamW at lr 1e-2 turns into updates of up to ~2e-6 (measured:
# 2.2e-6 absolute after 4 steps), as in test_tensor_parallel.py.
LAYOUT_TOLERANCE = 1e-5
# The 2x2 module computes its logits from partial sums all-reduced over the tensor-parallel pair: a few fp32 ulps
# of logits below 1 away from the whole matmuls (measured: 1.8e-7).
SPLIT_LOGITS = 1e-6


def export(checkpoint: Path, out: Path) -> None:
    """``fsdp-strategy consolidate CHECKPOINT OUT --format safetensors`` of the Llama at ``model.``, 20KB files."""
    command = [sys.executable, "-m", "fsdp_strategy", "consolidate", str(checkpoint), str(out)]
    command += ["--format", "safetensors", "--prefix", "model.", "--max-shard-size", "20KB", "--no-progress"]
    done = subprocess.run(command, cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "config.json from the hyper-parameter 'config'" in done.stdout, done.stdout


def exported_tensors(out: Path) -> dict[str, torch.Tensor]:
    files = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    return {name: t for filename in sorted(files) for name, t in safetensors_torch.load_file(out / filename).items()}


def test_a_llama_trained_on_two_ranks_exports_as_save_pretrained_writes_it_and_loads_with_from_pretrained(
    tmp_path: Path,
) -> None:
    checkpoint, reference, out = tmp_path / "llama.ckpt", tmp_path / "save_pretrained", tmp_path / "exported"
    args = ["--checkpoint", str(checkpoint), "--reference", str(reference), "--max-shard-size", "20KB"]
    torchrun("integration_tests.export_worker", [*args, "--out", str(tmp_path / "logits.pt")], nproc=2, cwd=tmp_path)
    assert (checkpoint / ".metadata").is_file()
    export(checkpoint, out)

    # The same files as save_pretrained of the trained model: the split, the index, every tensor.
    ours = json.loads((out / "model.safetensors.index.json").read_text())
    theirs = json.loads((reference / "model.safetensors.index.json").read_text())
    assert ours["weight_map"] == theirs["weight_map"] and ours["metadata"] == theirs["metadata"]
    assert len(set(ours["weight_map"].values())) > 1, "the size limit should have split the weights"
    for filename in sorted(set(theirs["weight_map"].values())):
        expected, actual = (
            safetensors_torch.load_file(reference / filename),
            safetensors_torch.load_file(out / filename),
        )
        assert actual.keys() == expected.keys(), filename
        assert all(torch.equal(actual[k], expected[k]) for k in expected), filename

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    saved = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        logits = loaded(input_ids=saved["tokens"]).logits
    assert torch.equal(logits, saved["logits"])


def test_a_llama_split_by_its_tensor_parallel_plan_exports_as_the_one_dimensional_run_and_loads_with_from_pretrained(
    tmp_path: Path,
) -> None:
    runs = {}
    for layout, tensor_parallel_size in (("2x2", "2"), ("4x1", "1")):
        checkpoint, out, trained = (
            tmp_path / f"{layout}.ckpt",
            tmp_path / f"{layout}_exported",
            tmp_path / f"{layout}.pt",
        )
        args = ["--checkpoint", str(checkpoint), "--max-shard-size", "20KB", "--out", str(trained)]
        args += ["--tensor-parallel-size", tensor_parallel_size]
        torchrun("integration_tests.export_worker", args, nproc=4, cwd=tmp_path)
        export(checkpoint, out)
        runs[layout] = {"out": out, "trained": torch.load(trained), "tensors": exported_tensors(out)}
    split, plain = runs["2x2"], runs["4x1"]
    assert "model.layers.0.self_attn.q_proj.weight" in split["trained"]["split"] and not plain["trained"]["split"]

    # The files of the 2x2 checkpoint are the trained module's whole tensors, named and split as the 4x1 run's.
    index = json.loads((split["out"] / "model.safetensors.index.json").read_text())
    assert index == json.loads((plain["out"] / "model.safetensors.index.json").read_text())
    assert split["tensors"].keys() == split["trained"]["state"].keys()
    assert all(torch.equal(split["tensors"][k], v) for k, v in split["trained"]["state"].items())
    assert all(torch.equal(plain["tensors"][k], v) for k, v in plain["trained"]["state"].items())
    # The two layouts trained on the same global batches.
    assert max_absolute_difference(split["tensors"], plain["tensors"]) <= LAYOUT_TOLERANCE

    for run in (split, plain):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(run["out"])
        with torch.no_grad():
            run["loaded"] = loaded(input_ids=run["trained"]["tokens"]).logits
    assert torch.equal(plain["loaded"], plain["trained"]["logits"])  # the 4x1 module is plain again after training
    torch.testing.assert_close(split["loaded"], split["trained"]["logits"], rtol=0, atol=SPLIT_LOGITS)
