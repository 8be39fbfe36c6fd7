"""``export_safetensors`` / ``consolidate --format safetensors`` on checkpoints written here: the files and
index ``save_pretrained`` would write, read back by the ``safetensors`` library, and the options' errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_strategy import consolidate_checkpoint, export_safetensors
from fsdp_strategy.checkpoint import writing
from fsdp_strategy.tools.cli import main

safetensors_torch = pytest.importorskip("safetensors.torch")

CONFIG = {"model_type": "llama", "hidden_size": 8}


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(10, 8, generator=generator),
        "model.layer.weight": torch.randn(8, 8, generator=generator).to(torch.bfloat16),
        "model.layer.bias": torch.randn(8, generator=generator),
        "model.step": torch.tensor(3),  # 0-d: not saved in row blocks, read whole
        "loss_fn.weight": torch.ones(4),  # another attribute of the LightningModule
    }


def lightning_checkpoint(state: dict[str, torch.Tensor]) -> dict:
    return {
        "state_dict": state,
        "optimizer_states": [],
        "hyper_parameters": {"config": CONFIG, "lr": 0.1},
        "global_step": 1,
    }


@pytest.fixture
def sharded(single_rank_group, tmp_path: Path) -> Path:
    path = tmp_path / "sharded.ckpt"
    writing.save_sharded(path, lightning_checkpoint(weights()), is_rank_zero=True)
    return path


def read_back(out: Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        loaded.update(safetensors_torch.load_file(out / name))
    return loaded


def test_a_sharded_checkpoint_exports_the_prefixed_weights_with_their_dtypes_and_the_config(sharded, tmp_path):
    summary = export_safetensors(sharded, tmp_path / "out", prefix="model.", progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    assert (summary.tensors, summary.left_out, summary.config) == (4, 1, "the hyper-parameter 'config'")
    expected = {k.removeprefix("model."): v for k, v in weights().items() if k.startswith("model.")}
    loaded = read_back(tmp_path / "out")
    assert loaded.keys() == expected.keys()
    assert all(loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) for k, v in expected.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == CONFIG


def test_above_the_size_limit_the_files_are_split_as_save_pretrained_splits_them(sharded, tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards

    consolidate_checkpoint(sharded, tmp_path / "out", format="safetensors", max_shard_size=300, progress=False)
    reference = split_torch_state_dict_into_shards({k: v for k, v in weights().items()}, max_shard_size=300)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == reference.tensor_to_filename
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in weights().values())
    assert read_back(tmp_path / "out").keys() == weights().keys()


def test_a_single_file_checkpoint_exports_too_with_a_config_given(tmp_path):
    torch.save(lightning_checkpoint(weights()), tmp_path / "full.ckpt")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    export_safetensors(
        tmp_path / "full.ckpt", tmp_path / "out", prefix="model.", config_from=tmp_path / "cfg", progress=False
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "gpt2"}
    assert torch.equal(read_back(tmp_path / "out")["layer.weight"], weights()["model.layer.weight"])


def test_bad_options_and_existing_files_are_named(sharded, tmp_path):
    with pytest.raises(ValueError, match=r"`prefix` 'encoder\.' matches no weight of"):
        export_safetensors(sharded, tmp_path / "out", prefix="encoder.", progress=False)
    with pytest.raises(ValueError, match="`config_from` must be a transformers PretrainedConfig"):
        export_safetensors(sharded, tmp_path / "out", config_from=3, progress=False)
    with pytest.raises(ValueError, match="`max_shard_size` must be"):
        export_safetensors(sharded, tmp_path / "out", max_shard_size="big", progress=False)
    with pytest.raises(ValueError, match="`prefix` is an option of format='safetensors'"):
        consolidate_checkpoint(sharded, tmp_path / "one.ckpt", prefix="model.")
    export_safetensors(sharded, tmp_path / "out", progress=False)
    with pytest.raises(FileExistsError, match="already holds config.json, model.safetensors"):
        export_safetensors(sharded, tmp_path / "out", progress=False)
    export_safetensors(sharded, tmp_path / "out", prefix="model.", overwrite=True, progress=False)
    assert "embed.weight" in read_back(tmp_path / "out")


def test_an_overwriting_export_removes_the_weight_files_of_the_earlier_one(sharded, tmp_path):
    out = tmp_path / "out"
    export_safetensors(sharded, out, max_shard_size=300, progress=False)
    export_safetensors(sharded, out, prefix="model.", overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    export_safetensors(sharded, out, max_shard_size=300, overwrite=True, progress=False)
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names, names
    (out / "notes.txt").write_text("kept")
    export_safetensors(sharded, out, prefix="model.", overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]


def test_the_command_exports_and_refuses_safetensors_options_for_a_lightning_file(sharded, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(["consolidate", str(sharded), str(out), "--format", "safetensors", "--prefix", "model.", "--no-progress"])
        == 0
    )
    assert "4 tensors" in capsys.readouterr().out and (out / "model.safetensors").is_file()
    assert main(["consolidate", str(sharded), str(tmp_path / "x.ckpt"), "--prefix", "model."]) == 2
    assert "--prefix is an option of --format safetensors" in capsys.readouterr().err
