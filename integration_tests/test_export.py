"""A tiny Hugging Face Llama trained under "fsdp2" on 2 ranks, exported with ``fsdp-strategy consolidate
--format safetensors``: the files ``save_pretrained`` writes for the trained model, loadable by ``from_pretrained``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from integration_tests.conftest import REPO, _environment, torchrun

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def test_a_llama_trained_on_two_ranks_exports_as_save_pretrained_writes_it_and_loads_with_from_pretrained(
    tmp_path: Path,
) -> None:
    checkpoint, reference, out = tmp_path / "llama.ckpt", tmp_path / "save_pretrained", tmp_path / "exported"
    args = ["--checkpoint", str(checkpoint), "--reference", str(reference), "--max-shard-size", "20KB"]
    torchrun("integration_tests.export_worker", [*args, "--out", str(tmp_path / "logits.pt")], nproc=2, cwd=tmp_path)
    assert (checkpoint / ".metadata").is_file()

    command = [
        sys.executable,
        "-m",
        "fsdp_strategy",
        "consolidate",
        str(checkpoint),
        str(out),
        "--format",
        "safetensors",
    ]
    command += ["--prefix", "model.", "--max-shard-size", "20KB", "--no-progress"]
    done = subprocess.run(command, cwd=REPO, env=_environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "config.json from the hyper-parameter 'config'" in done.stdout, done.stdout

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
