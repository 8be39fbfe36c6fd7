"""``fsdp-strategy consolidate --format peft`` on a real 1-rank group: from an adapter, sharded or full checkpoint of
a LoRA run, the folder peft's own ``save_pretrained`` writes from the trained module, which
``PeftModel.from_pretrained`` loads to the run's logits."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from fsdp_strategy import FSDP2Strategy, consolidate_checkpoint
from fsdp_strategy.tools.cli import main
from fsdp_strategy.tools.export_peft import export_peft
from testkit.hf import LoraLlama, save_tiny_llama
from testkit.models import TinyLM, token_loader

pytest.importorskip("peft")


def train(root: Path, kind: str, module: L.LightningModule) -> Path:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(state_dict_type=kind),
        max_steps=3,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, token_loader(batch_size=4, samples=12))
    path = root / f"{kind}.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("kind", ["adapter", "sharded", "full"])
def test_the_export_is_what_peft_saves_from_the_trained_module_and_loads_to_its_logits(
    trainer_env, tmp_path, kind
) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base = save_tiny_llama(str(tmp_path / "base"))
    module = LoraLlama(base)
    path = train(tmp_path, kind, module)
    out = tmp_path / "exported"
    assert main(["consolidate", "--format", "peft", "--no-progress", str(path), str(out)]) == 0

    reference = tmp_path / "save_pretrained"
    module.model.save_pretrained(reference)  # after fit the module is plain again, as under DDP
    exported, saved = load_file(out / "adapter_model.safetensors"), load_file(reference / "adapter_model.safetensors")
    assert list(exported) == list(saved) and len(saved) == 8  # q_proj and v_proj, A and B, 2 layers
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    config, theirs = (json.loads((folder / "adapter_config.json").read_text()) for folder in (out, reference))
    # peft writes the set of target modules in the order the set iterates (str hashes vary per process); ours sorted.
    assert config.pop("target_modules") == sorted(theirs.pop("target_modules")) == ["q_proj", "v_proj"]
    assert config == theirs

    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), out).eval()
    module.eval()
    with torch.no_grad():
        logits, expected = loaded(input_ids=tokens).logits, module(tokens)
        untrained = LlamaForCausalLM.from_pretrained(base)(input_ids=tokens).logits
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(untrained, expected, atol=1e-4)  # the adapters changed the logits


def test_a_checkpoint_without_peft_adapters_is_named(trainer_env, tmp_path) -> None:
    path = train(tmp_path, "sharded", TinyLM(n_layer=1))
    with pytest.raises(ValueError, match=rf"'{path}' records no peft adapters"):
        export_peft(path, tmp_path / "out", progress=False)


def test_an_existing_adapter_is_kept_unless_overwrite(trainer_env, tmp_path) -> None:
    path = train(tmp_path, "adapter", LoraLlama(save_tiny_llama(str(tmp_path / "base"))))
    export_peft(path, tmp_path / "out", progress=False)
    with pytest.raises(FileExistsError, match="already holds adapter_model.safetensors, adapter_config.json"):
        export_peft(path, tmp_path / "out", progress=False)
    summary = export_peft(path, tmp_path / "out", progress=False, overwrite=True)
    assert summary.adapters == ["default"] and summary.tensors == 8


def test_the_options_of_other_formats_are_refused_naming_them(tmp_path, capsys) -> None:
    assert main(["consolidate", "--format", "peft", "--max-shard-size", "1GB", "x.ckpt", str(tmp_path / "out")]) == 2
    assert "--max-shard-size is an option of --format safetensors; got '1GB' with --format peft" in (
        capsys.readouterr().err
    )
    with pytest.raises(
        ValueError, match="`config_from` is an option of format='safetensors'; got 'c' with format='peft'"
    ):
        consolidate_checkpoint("x.ckpt", tmp_path / "out", format="peft", config_from="c")
    with pytest.raises(ValueError, match="`format` must be 'lightning' .*, 'safetensors' or 'peft'; got 'lora'"):
        consolidate_checkpoint("x.ckpt", tmp_path / "out", format="lora")


class OwnConfigLM(TinyLM):
    """A module that keeps a plain dict of its own under the name peft uses (to build adapters later, say)."""

    def __init__(self) -> None:
        super().__init__(n_layer=1)
        self.peft_config = {"r": 8, "target_modules": ["q_proj"]}


def test_a_peft_config_that_is_not_peft_s_is_no_peft_model(trainer_env, tmp_path) -> None:
    path = train(tmp_path, "sharded", OwnConfigLM())  # saved: nothing taken for adapters
    with pytest.raises(ValueError, match="records no peft adapters"):
        export_peft(path, tmp_path / "out", progress=False)
