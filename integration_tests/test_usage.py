"""Ordinary scripts give under "fsdp2" what they give under "ddp": 2 ranks, Lightning's own launcher.

See usage_worker.py for the scenarios: weights loaded in configure_model, a model built with
init_module(empty_init=True), batches under bf16-mixed, the module after fit, and the end of a script.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from integration_tests.conftest import launch, max_relative_difference


def parameters(state: dict) -> dict:
    return {k: v for k, v in state.items() if "inv_freq" not in k}


@pytest.fixture
def pretrained(tmp_path: Path) -> Path:
    from transformers import LlamaForCausalLM

    from integration_tests.usage_worker import llama_config

    torch.manual_seed(123)
    model = LlamaForCausalLM(llama_config())
    directory = tmp_path / "pretrained"
    model.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "weights.pt")
    return directory


def test_ordinary_scripts_match_ddp(tmp_path: Path, pretrained: Path) -> None:
    args = ["--strategies", "ddp,fsdp2,fsdp2_sharded", "--pretrained", str(pretrained), "--directory", str(tmp_path)]
    results = launch(args, tmp_path, nproc=2, launcher="lightning", module="integration_tests.usage_worker")
    weights = torch.load(pretrained / "weights.pt")

    # Weights loaded in configure_model (from_pretrained, or load_state_dict) are what training starts from.
    for how in ("from_pretrained", "load_state_dict"):
        for strategy in ("ddp", "fsdp2"):
            start = results[f"{strategy}/fine_tune"][how]["start"]
            for name, tensor in weights.items():
                assert torch.equal(start[f"model.{name}"], tensor), (strategy, how, name)
        sharded, reference = results["fsdp2/fine_tune"][how]["final"], results["ddp/fine_tune"][how]["final"]
        assert max_relative_difference(sharded, reference) <= 1e-5, how

    # init_module(empty_init=True): buffers of the eager build, Hugging Face's own init, rows written as written,
    # and each rank's shard its own random draw.
    built = results["fsdp2/deferred"]
    state, eager = built["state"], built["eager"]
    for name in ("model.model.rotary_emb.inv_freq", "model.model.rotary_emb.original_inv_freq"):
        assert torch.equal(state[name], eager[name]), name
    assert torch.equal(state["probe.positions"], eager["probe.positions"])
    for name, tensor in state.items():
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        elif name.endswith("proj.weight") or name.endswith("lm_head.weight"):
            assert tensor.std().item() == pytest.approx(eager[name].std().item(), rel=0.2), name
    rank0, rank1 = built["shards"]
    assert rank0.shape == rank1.shape == (32, 16)
    assert not torch.allclose(rank0, rank1), "shards drawn from the same random stream on every rank"
    assert torch.equal(state["model.model.embed_tokens.weight"][3], torch.zeros(16))  # the padding row

    # bf16-mixed: the step methods see the batch's own dtypes, and training stays as close to fp32 as DDP's.
    for strategy in ("ddp", "fsdp2"):
        for precision in ("32-true", "bf16-mixed"):
            dtypes = results[f"{strategy}/regression"][precision]["dtypes"]
            assert dtypes.keys() == {"train", "validate", "test", "predict"}
            assert all(seen == ["torch.float32"] * 3 for seen in dtypes.values()), (strategy, precision, dtypes)
    fp32 = results["ddp/regression"]["32-true"]["final"]
    assert max_relative_difference(results["fsdp2/regression"]["32-true"]["final"], fp32) <= 1e-5
    ddp_distance = max_relative_difference(results["ddp/regression"]["bf16-mixed"]["final"], fp32)
    sharded_distance = max_relative_difference(results["fsdp2/regression"]["bf16-mixed"]["final"], fp32)
    assert sharded_distance <= 2 * ddp_distance, (sharded_distance, ddp_distance)

    # After fit: test(ckpt_path="best"), a plain module (state_dict, load_state_dict, torch.save, inference on
    # rank 0 alone), and load_from_checkpoint of the best checkpoint.
    reference = results["ddp/after_fit"]
    assert reference["best_is_file"]
    for strategy in ("fsdp2", "fsdp2_sharded"):
        run = results[f"{strategy}/after_fit"]
        for metric, value in reference["test_metrics"].items():
            assert run["test_metrics"][metric] == pytest.approx(value, rel=1e-5), (strategy, metric)
        assert run["state_dict_types"] == reference["state_dict_types"] == ["Tensor"]
        assert max_relative_difference(run["state_dict"], reference["state_dict"]) <= 1e-5, strategy
        assert run["pickled_bytes"] > 0
        assert torch.allclose(run["rank0_logits"], reference["rank0_logits"], rtol=1e-4, atol=1e-5), strategy
    assert results["fsdp2/after_fit"]["best_is_file"]  # "auto": one file while the state fits rank 0's memory
    assert (
        max_relative_difference(results["fsdp2/after_fit"]["loaded_from_best"], reference["loaded_from_best"]) <= 1e-5
    )
    sharded = results["fsdp2_sharded/after_fit"]
    assert not sharded["best_is_file"]
    assert sharded["loaded_from_best"].startswith("IsADirectoryError")  # documented: consolidate first
    assert max_relative_difference(sharded["loaded_from_consolidated"], reference["loaded_from_best"]) <= 1e-5
