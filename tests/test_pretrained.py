"""Pretrained Hugging Face weights into a sharded module (``init_weights`` = a ``save_pretrained`` directory) on a
1-rank group: the module's names behind a prefix (a LightningModule's attribute, peft's wrapping), tied weights,
dtype casts, and each missing, extra or mis-shaped key named. Several ranks: integration_tests/test_pretrained.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.distributed.fsdp import fully_shard

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.checkpoint.pretrained import TensorHeader, load_pretrained, local_region, read_headers
from testkit.hf import UNEVEN_LLAMA, PretrainedLlama
from testkit.models import token_loader

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def llama(**overrides) -> torch.nn.Module:
    torch.manual_seed(5)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**UNEVEN_LLAMA, **overrides}))


def saved(model: torch.nn.Module, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, **kwargs)
    return directory


def fit_zero_steps(module: L.LightningModule, weights: Path, *, meta_init: bool = True) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(init_weights=str(weights), meta_init=meta_init),
        max_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, token_loader())


def logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = next(iter(token_loader()))[0]
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("meta_init", [True, False], ids=["meta-init", "eager"])
@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["one-file", "index"])
def test_a_fit_starts_from_the_weights_of_from_pretrained(trainer_env, tmp_path, meta_init, max_shard_size):
    weights = saved(llama(), tmp_path / "w", **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    module = PretrainedLlama(transformers.LlamaConfig(**UNEVEN_LLAMA).to_dict())
    fit_zero_steps(module, weights, meta_init=meta_init)
    reference = transformers.AutoModelForCausalLM.from_pretrained(weights)
    assert torch.equal(logits(module.model), logits(reference))


def test_tied_weights_load_through_the_name_the_file_holds(trainer_env, tmp_path):
    weights = saved(llama(tie_word_embeddings=True), tmp_path / "w")
    headers = read_headers(weights)
    assert "lm_head.weight" not in headers and "model.embed_tokens.weight" in headers  # left out of the file
    module = PretrainedLlama(transformers.LlamaConfig(**UNEVEN_LLAMA, tie_word_embeddings=True).to_dict())
    fit_zero_steps(module, weights)
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    assert torch.equal(logits(module.model), logits(transformers.AutoModelForCausalLM.from_pretrained(weights)))


@pytest.mark.parametrize(
    ("file_dtype", "param_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_each_tensor_is_cast_to_its_parameters_dtype(single_rank_group, mesh, tmp_path, file_dtype, param_dtype):
    weights = saved(llama().to(file_dtype), tmp_path / "w")
    assert read_headers(weights)["lm_head.weight"] == TensorHeader("model.safetensors", (37, 36), file_dtype)
    model = llama(tie_word_embeddings=False).to(param_dtype)
    fully_shard(model, mesh=mesh)
    load_pretrained(model, weights, strict=True)
    files = safetensors_torch.load_file(weights / "model.safetensors")
    for name, param in model.named_parameters():
        assert param.dtype == param_dtype
        assert torch.equal(param.full_tensor(), files[name].to(param_dtype)), name


def test_a_plain_tensor_is_read_whole_and_a_dtensor_on_one_rank_too(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    plain = torch.zeros(5, 3)
    assert local_region(plain) == (slice(0, 5), slice(0, 3))
    assert local_region(distribute_tensor(plain, mesh, [Shard(0)])) == (slice(0, 5), slice(0, 3))


class LoraLlama(L.LightningModule):
    """What a LoRA recipe holds: peft's wrapping of the pretrained Llama (``model.base_model.model.``...)."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(llama(), lora)


def test_peft_wrapped_layers_take_the_base_weights_and_keep_their_adapters(single_rank_group, mesh, tmp_path):
    pytest.importorskip("peft")
    source = llama()
    weights = saved(source, tmp_path / "w")
    torch.manual_seed(9)  # other base weights than the file's
    module = LoraLlama()
    for param in module.parameters():
        param.data.normal_()
    adapters = {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}
    fully_shard(module, mesh=mesh)
    load_pretrained(module, weights, strict=True)
    state = {n: p.full_tensor() for n, p in module.named_parameters()}
    q = "model.base_model.model.model.layers.0.self_attn.q_proj"
    assert torch.equal(state[f"{q}.base_layer.weight"], source.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(state["model.base_model.model.lm_head.weight"], source.lm_head.weight)
    assert all(torch.equal(state[n], value) for n, value in adapters.items())


def damage(weights: Path, change) -> None:
    tensors = safetensors_torch.load_file(weights / "model.safetensors")
    change(tensors)
    safetensors_torch.save_file(tensors, weights / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_key_is_named_on_every_rank(trainer_env, tmp_path):
    weights = saved(llama(), tmp_path / "w")
    damage(weights, lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"))
    message = (
        f"Hugging Face weights '{weights}': 1 parameter(s) of the module are not in the weights:"
        " ['model.model.layers.1.mlp.up_proj.weight'] (their file keys would be ['model.layers.1.mlp.up_proj.weight'])."
        " Set `self.strict_loading = False` in the LightningModule to keep their initialization."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fit_zero_steps(PretrainedLlama(transformers.LlamaConfig(**UNEVEN_LLAMA).to_dict()), weights)


def test_an_extra_key_is_named_with_its_file_and_shape(single_rank_group, mesh, tmp_path):
    weights = saved(llama(), tmp_path / "w")
    damage(weights, lambda tensors: tensors.update({"model.layers.0.mlp.extra.weight": torch.ones(4, 2)}))
    model = PretrainedLlama(transformers.LlamaConfig(**UNEVEN_LLAMA).to_dict())
    model.configure_model()
    fully_shard(model, mesh=mesh)
    message = (
        f"Hugging Face weights '{weights}': 1 tensor(s) the module has no parameter for (looked for them under"
        " 'model.'): 'model.layers.0.mlp.extra.weight' (model.safetensors, (4, 2)). Set `self.strict_loading ="
        " False` in the LightningModule to leave them out."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        load_pretrained(model, weights, strict=True)
    load_pretrained(model, weights, strict=False)  # the extra tensor left out


def test_a_tensor_of_another_shape_is_refused_also_when_not_strict(single_rank_group, mesh, tmp_path):
    weights = saved(llama(), tmp_path / "w", max_shard_size="20KB")
    index = json.loads((weights / "model.safetensors.index.json").read_text())
    file = index["weight_map"]["model.norm.weight"]
    tensors = safetensors_torch.load_file(weights / file)
    tensors["model.norm.weight"] = torch.ones(35)
    safetensors_torch.save_file(tensors, weights / file, metadata={"format": "pt"})
    model = llama()
    fully_shard(model, mesh=mesh)
    message = (
        f"Hugging Face weights '{weights}': 'model.norm.weight' in '{file}' has shape (35,), but the module's"
        " 'model.norm.weight' has shape (36,)."
    )
    for strict in (True, False):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_pretrained(model, weights, strict=strict)


def test_a_directory_without_weights_or_with_a_broken_index_is_refused_by_the_option(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    message = (
        f"`init_weights`: Hugging Face weights '{empty}' hold neither 'model.safetensors' nor"
        " 'model.safetensors.index.json' (what `save_pretrained` writes)."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        FSDP2Strategy(init_weights=str(empty))
    weights = saved(llama(), tmp_path / "w", max_shard_size="20KB")
    lost = sorted(weights.glob("model-*.safetensors"))[0]
    lost.unlink()
    message = (
        f"`init_weights`: Hugging Face weights '{weights}': 'model.safetensors.index.json' names files that are not"
        f" there: ['{lost.name}']."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        FSDP2Strategy(init_weights=str(weights))


class LlamaFromConfig(torch.nn.Module):
    """The Llama a recipe builds from the directory's config, for the estimator's reference."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama()


def test_the_estimator_reads_a_weights_directory_from_its_headers_as_the_model_built_from_its_config(tmp_path):
    from fsdp_strategy.estimator.report import estimate

    weights = saved(llama(), tmp_path / "w", max_shard_size="20KB")
    from_headers = estimate(str(weights), world_sizes=[1, 2, 4])
    from_config = estimate(LlamaFromConfig, world_sizes=[1, 2, 4])
    assert from_headers.model == str(weights)
    assert from_headers.num_params == from_config.num_params == sum(p.numel() for p in llama().parameters())
    assert [row.as_dict() for row in from_headers.rows] == [row.as_dict() for row in from_config.rows]
    message = (
        f"The Hugging Face weights '{weights}' hold parameters, not the model's code: `batch_size` (a traced step)"
        " and `init_args` need the module given as 'MODULE:Class'."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        estimate(str(weights), world_sizes=[2], batch_size=2, seq_len=8)


def test_the_estimate_command_takes_a_weights_directory(tmp_path, capsys):
    from fsdp_strategy.tools.cli import main

    weights = saved(llama(), tmp_path / "w")
    assert main(["estimate", str(weights), "--world-sizes", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == str(weights)
    assert report["num_params"] == sum(p.numel() for p in llama().parameters())
    assert {row["strategy"] for row in report["rows"]} >= {"ddp", "fsdp2"}


class LlamaWithHead(torch.nn.Module):
    """A new head beside the pretrained model: its parameters are outside the prefix the file matches."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = llama()
        self.head = torch.nn.Linear(36, 3)


def test_a_new_module_beside_the_pretrained_model_keeps_its_initialization(single_rank_group, mesh, tmp_path):
    source = llama()
    weights = saved(source, tmp_path / "w")
    model = LlamaWithHead()
    for param in model.backbone.parameters():
        param.data.zero_()
    head = model.head.weight.detach().clone()
    fully_shard(model, mesh=mesh)
    load_pretrained(model, weights, strict=True)
    assert torch.equal(model.head.weight.full_tensor(), head)
    assert torch.equal(model.backbone.model.norm.weight.full_tensor(), source.model.norm.weight)


def test_a_truncated_weights_file_is_named(tmp_path):
    weights = saved(llama(), tmp_path / "w")
    file = weights / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    message = (
        f"`init_weights`: Hugging Face weights '{weights}': 'model.safetensors' is not a readable safetensors file ("
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        FSDP2Strategy(init_weights=str(weights))
