"""The examples run as their README shows, on 2 CPU processes through Lightning's own launcher (the LoRA
fine-tune also on 4, as 2 data x 2 tensor ranks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from integration_tests.conftest import REPO, _environment, _run
from testkit import free_port


@pytest.mark.parametrize(("devices", "tensor_parallel_size"), [(2, 1), (4, 2)], ids=["2ranks", "2x2"])
def test_finetune_lora_exports_an_adapter_that_peft_loads_to_the_runs_logits(
    tmp_path: Path, devices: int, tensor_parallel_size: int
) -> None:
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    env = {**_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, str(REPO / "examples" / "finetune_lora.py"), "--devices", str(devices)]
    command += ["--max-steps", "12", "--tensor-parallel-size", str(tensor_parallel_size)]
    printed = _run([*command, "--out", str(out)], cwd=tmp_path, env=env, check=True, timeout=600).stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["loss_last"] < summary["loss_first"]
    assert f"on {devices} processes" in printed and "max |logits difference|" in printed
    if tensor_parallel_size == 1:
        assert summary["max_logit_difference"] == 0
    else:  # split over tensor-parallel ranks the run's sums go in another order than one process's (measured: 4e-7)
        assert summary["max_logit_difference"] <= 1e-5
    # The checkpoint is an adapter checkpoint: it records the base directory and leaves the frozen weights out.
    record = json.loads((out / "lora.ckpt" / "adapter.json").read_text())
    assert record["init_weights"]["path"] == str(out / "base")
    assert "model.base_model.model.model.layers.0.mlp.up_proj.base_layer.weight" in record["frozen"]

    # One process, as a peft user would: the exported adapter on the saved base gives the fine-tuned run's logits.
    run = torch.load(out / "finetuned_logits.pt")
    base = AutoModelForCausalLM.from_pretrained(out / "base")
    model = PeftModel.from_pretrained(base, out / "adapter").eval()
    with torch.no_grad():
        logits = model(input_ids=run["tokens"]).logits
        with model.disable_adapter():
            base_logits = model(input_ids=run["tokens"]).logits
    assert torch.allclose(logits, run["logits"], rtol=0, atol=1e-5)
    assert (base_logits - run["logits"]).abs().max() > 0.1  # the adapter carries what the run learned
