"""Deferred construction (``init_module(empty_init=True)``, ``meta_init=True``) on a real 1-rank group: buffers
exactly as an eager build computes them, parameters initialized with the eager build's own scheme, and an
error before training where that cannot be done. Shards on several ranks (rows split unevenly, broadcasts,
hybrid meshes): integration_tests/test_deferred.py."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile

from fsdp_strategy.sharding.deferred_init import (
    DeferredInitError,
    DeferredTensor,
    deferred_init,
    materialize,
    records_by_name,
)
from testkit import full

CPU = torch.device("cpu")


def shard_and_materialize(model: nn.Module, mesh, units: list[nn.Module] = ()) -> None:
    records = records_by_name(model)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize(model, CPU, records)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=3, initializer_range=0.02,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_a_hugging_face_llama_gets_its_buffers_and_its_own_init(mesh):
    torch.manual_seed(0)
    eager = tiny_llama()
    with deferred_init(CPU):
        model = tiny_llama()
    assert isinstance(model.lm_head.weight, nn.Parameter) and model.lm_head.weight.is_meta
    # Non-persistent buffers computed in __init__ (rotary inv_freq) are those of the eager build, bit for bit.
    buffers = dict(eager.named_buffers())
    assert buffers and all(torch.equal(buffer, buffers[name]) for name, buffer in model.named_buffers())

    shard_and_materialize(model, mesh, list(model.model.layers))

    for name, param in model.named_parameters():
        assert not param.is_meta and torch.isfinite(full(param)).all(), name
    assert all(torch.equal(buffer, buffers[name]) for name, buffer in model.named_buffers())
    embedding = full(model.model.embed_tokens.weight)
    assert torch.equal(embedding[3], torch.zeros(16))  # the padding row Hugging Face zeroes
    for name, param in model.named_parameters():
        values, reference = full(param), dict(eager.named_parameters())[name]
        if name.endswith("norm.weight"):
            assert torch.equal(values, reference), name  # fill_(1.0)
        else:
            # Hugging Face's normal(0, initializer_range), not torch's default Linear init (std ~0.14 here).
            assert values.std().item() == pytest.approx(0.02, rel=0.25), name


class NanoGPTStyle(nn.Module):
    """Initializes everything after construction with apply(), as nanoGPT does, scaling residual projections."""

    def __init__(self, n_layer: int = 2, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.Linear(4 * width, width)) for _ in range(n_layer)
        )
        self.apply(self._init_weights)
        for layer in self.layers:
            nn.init.normal_(layer[1].weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)


def test_init_done_outside_reset_parameters_is_replayed(mesh):
    with deferred_init(CPU):
        model = NanoGPTStyle()
    shard_and_materialize(model, mesh, list(model.layers))
    for layer in model.layers:
        assert full(layer[0].weight).std().item() == pytest.approx(0.02, rel=0.1)
        assert full(layer[1].weight).std().item() == pytest.approx(0.01, rel=0.1)
        assert torch.equal(full(layer[0].bias), torch.zeros(128))


def test_weights_loaded_during_construction_are_kept_exactly(mesh):
    torch.manual_seed(0)
    source = NanoGPTStyle()
    with deferred_init(CPU):
        model = NanoGPTStyle()
        model.load_state_dict(source.state_dict())
    shard_and_materialize(model, mesh, list(model.layers))
    for name, param in model.named_parameters():
        assert torch.equal(full(param), source.state_dict()[name]), name


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((8,), 3.0))  # created with its values, no reset_parameters()
        self.scale = nn.Parameter(torch.randn(6, 4) * 0.5)
        self.truncated = nn.Linear(64, 32)
        nn.init.trunc_normal_(self.truncated.weight, std=0.02, a=-0.04, b=0.04)  # reads its values: built in full
        self.rotation = nn.Linear(8, 8, bias=False)
        nn.init.orthogonal_(self.rotation.weight)  # reads its values, needs the whole matrix
        self.embedding = nn.Embedding(10, 4, padding_idx=2)
        with torch.no_grad():
            self.embedding.weight[5:7].fill_(7.0)  # a block of rows
        self.register_buffer("twice_gain", self.gain.detach() * 2)  # a buffer computed from a parameter


def test_values_given_at_creation_reads_and_row_writes_are_reproduced(mesh):
    torch.manual_seed(0)
    with deferred_init(CPU):
        model = Custom()
    assert torch.equal(model.twice_gain, torch.full((8,), 6.0))
    scale_at_creation = model.scale._fsdp_strategy_deferred.initial.clone()
    shard_and_materialize(model, mesh)

    assert torch.equal(full(model.gain), torch.full((8,), 3.0))
    assert torch.equal(full(model.scale), scale_at_creation)
    weight = full(model.truncated.weight)
    assert weight.abs().max() <= 0.04 and weight.std().item() == pytest.approx(0.02, rel=0.2)
    rotation = full(model.rotation.weight)
    assert torch.allclose(rotation @ rotation.T, torch.eye(8), atol=1e-5)
    embedding = full(model.embedding.weight)
    assert torch.equal(embedding[2], torch.zeros(4)) and torch.equal(embedding[5:7], torch.full((2, 4), 7.0))
    assert embedding[[0, 1, 3, 4, 7, 8, 9]].std() > 0.5  # the rest: N(0, 1)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 4)
        self.head = nn.Linear(4, 12, bias=False)
        self.head.weight = self.embed.weight


def test_tied_parameters_stay_tied_and_keep_the_first_owners_init(mesh):
    with deferred_init(CPU):
        model = Tied()
    assert model.head.weight is model.embed.weight
    shard_and_materialize(model, mesh)
    assert model.head.weight is model.embed.weight
    assert full(model.embed.weight).std() > 0.5  # Embedding's N(0, 1), not the head's Linear init


def test_deferred_parameters_have_no_memory_but_the_real_device_and_dtype():
    with deferred_init(CPU):
        layer = nn.Linear(4, 3)
        seen = (type(layer.weight), layer.weight.device, layer.weight.is_meta)
        with torch.no_grad():
            view = layer.weight[1]
    assert seen == (DeferredTensor, CPU, False)
    assert isinstance(view, DeferredTensor) and view.shape == (4,)
    assert layer.weight.is_meta and layer.weight.dtype == torch.float32
    with deferred_init(CPU), torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            half = nn.Linear(4, 3)
        finally:
            torch.set_default_dtype(torch.float32)
    assert half.weight.dtype == torch.bfloat16


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gain = NoReset()


def test_a_model_built_under_a_plain_meta_device_uses_reset_parameters_or_fails_loudly(mesh):
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    shard_and_materialize(layers, mesh)
    assert full(layers[0].weight).std() > 0 and torch.equal(full(layers[1].weight), torch.ones(4))

    with torch.device("meta"):
        net = Net()
    message = (
        "These tensors are on the meta device and the strategy cannot give them the values your code would:"
        " parameters 'gain.weight' (NoReset, no reset_parameters())."
    )
    with pytest.raises(DeferredInitError, match=re.escape(message)):
        shard_and_materialize(net, mesh)


def test_a_meta_buffer_is_an_error_before_anything_is_allocated(mesh):
    with torch.device("meta"):
        norm = nn.BatchNorm1d(4)
    with pytest.raises(DeferredInitError, match=re.escape("buffer 'running_mean'")):
        shard_and_materialize(norm, mesh)


def test_tensors_built_eagerly_next_to_deferred_ones_keep_their_values(mesh):
    with deferred_init(CPU):
        model = nn.Sequential(nn.Linear(4, 4))
    head = nn.Linear(4, 3)  # built for real afterwards (a pretrained head added in configure_model)
    with torch.no_grad():
        head.weight.copy_(torch.arange(12.0).reshape(3, 4))
        head.bias.fill_(3.0)
    head.register_buffer("stat", torch.full((3,), 7.0))
    model.append(head)
    shard_and_materialize(model, mesh)
    assert torch.equal(full(model[1].weight), torch.arange(12.0).reshape(3, 4))
    assert torch.equal(full(model[1].bias), torch.full((3,), 3.0))
    assert torch.equal(model[1].stat, torch.full((3,), 7.0))
    assert full(model[0].weight).abs().max() <= 0.5  # Linear(4, 4)'s own init: U(-1/2, 1/2)


REF = torch.arange(40.0).reshape(8, 5)


def build_ops(holder: nn.Module) -> None:
    """Writes that are not row by row, ops with ``out=``, a CPU index, ``t_()``, ``.data =`` and conversions."""
    holder.cumsum = nn.Parameter(torch.zeros(8, 5))
    holder.renorm = nn.Parameter(torch.zeros(8, 5))
    holder.addmm = nn.Parameter(torch.zeros(8, 5))
    holder.indexed = nn.Parameter(torch.zeros(8, 5))
    holder.out = nn.Parameter(torch.zeros(8, 5))
    holder.column = nn.Parameter(torch.empty(1, 5))
    holder.assigned = nn.Parameter(torch.empty(8, 5))
    holder.halved = nn.Linear(5, 2)
    with torch.no_grad():
        holder.cumsum.copy_(REF).cumsum_(0)
        holder.renorm.copy_(REF).renorm_(2, 1, 1.0)
        holder.addmm.copy_(REF).addmm_(REF[:, :3], torch.ones(3, 5))
        holder.indexed.copy_(REF)
        holder.indexed[[1, 6]] = -1.0
        holder.indexed.index_fill_(0, torch.tensor([3]), 9.0)
        torch.add(REF, 1.0, out=holder.out)
        holder.column.copy_(torch.arange(5.0).reshape(1, 5))
        holder.column.t_()
        holder.column.mul_(2)
        holder.assigned.data = REF * 3
        holder.halved.weight.copy_(REF[:2])
        holder.halved.bias.fill_(0.1)
    holder.halved.half()
    with torch.no_grad():
        holder.halved.weight.mul_(0.3)


def test_writes_that_are_not_row_by_row_out_ops_data_assignment_and_conversions_give_the_eager_values(mesh):
    eager = nn.Module()
    build_ops(eager)
    with deferred_init(CPU):
        model = nn.Module()
        build_ops(model)
    assert model.column.shape == (5, 1) and model.halved.weight.dtype == torch.float16
    shard_and_materialize(model, mesh)
    for name, reference in eager.named_parameters():
        values = full(dict(model.named_parameters())[name])
        assert values.dtype == reference.dtype and torch.equal(values, reference), name


class SharedObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.Parameter(torch.randn(6, 4))
        self.encoder, self.decoder = nn.Module(), nn.Module()
        self.encoder.weight = shared  # tied by assigning one Parameter object to two modules
        self.decoder.weight = shared


def test_one_parameter_object_assigned_to_two_modules_stays_one_parameter(mesh):
    torch.manual_seed(0)
    eager = SharedObject()
    torch.manual_seed(0)
    with deferred_init(CPU):
        model = SharedObject()
    assert model.encoder.weight is model.decoder.weight and len(list(model.parameters())) == 1
    shard_and_materialize(model, mesh)
    assert model.encoder.weight is model.decoder.weight
    assert torch.equal(full(model.encoder.weight), eager.encoder.weight)


def test_deep_copies_replay_to_their_sources_values_and_go_on_on_their_own(mesh):
    with deferred_init(CPU):
        # nn.TransformerEncoder deep-copies its layer: eagerly, every layer starts as the same copy.
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False)
        # nn.Transformer then re-initializes every copy (xavier_uniform_): eagerly, the layers differ.
        transformer = nn.Transformer(8, 2, 2, 1, 16)
        source = nn.Linear(4, 4)
        duplicate = copy.deepcopy(source)
        with torch.no_grad():
            duplicate.weight.mul_(2)
    pair = nn.Sequential(source, duplicate)
    for model in (encoder, transformer, pair):
        shard_and_materialize(model, mesh)
    first, second = (dict(layer.named_parameters()) for layer in encoder.layers)
    for name, values in first.items():
        assert torch.equal(full(values), full(second[name])), name
    assert torch.equal(full(first["self_attn.in_proj_bias"]), torch.zeros(24))  # MultiheadAttention's constant_(0)
    assert full(first["linear1.weight"]).abs().max() <= 1 / math.sqrt(8)  # Linear's init
    layers = transformer.encoder.layers
    assert not torch.allclose(full(layers[0].linear1.weight), full(layers[1].linear1.weight))
    assert full(layers[0].linear1.weight).std().item() == pytest.approx(math.sqrt(2 / 24), rel=0.25)  # xavier
    assert torch.equal(full(duplicate.weight), 2 * full(source.weight))
    assert torch.equal(full(duplicate.bias), full(source.bias))


def test_new_tensors_made_from_a_deferred_one_need_no_memory_of_its_size():
    with deferred_init(CPU):
        layer = nn.Linear(1024, 1024)  # 4 MiB
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            made = layer.weight.new_zeros(1)
    assert torch.equal(made, torch.zeros(1))
    assert sum(max(event.cpu_memory_usage, 0) for event in profiler.events()) < 1024


def test_the_memory_a_parameter_was_created_with_is_freed_once_its_init_overwrites_it():
    with deferred_init(CPU):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            layers = [nn.Linear(512, 512) for _ in range(4)]  # torch.empty, then reset_parameters(): 1 MiB each
    assert len(layers) == 4
    assert sum(event.cpu_memory_usage for event in profiler.events()) < 512 * 512 * 4


class FromScratch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Parameter(torch.empty(3)), nn.Parameter(torch.empty(3))
        scratch = torch.empty(3)
        with torch.no_grad():
            for param, value in ((self.first, 1.0), (self.second, 2.0)):
                scratch.fill_(value)  # eagerly `first` keeps 1.0; its record only holds `scratch`
                param.copy_(scratch)


def test_a_tensor_modified_after_a_parameter_copied_from_it_is_an_error_not_other_values(mesh):
    with deferred_init(CPU):
        model = FromScratch()
    message = (
        "A tensor that `aten.copy_.default` wrote into FromScratch.first during construction was modified in place"
    )
    with pytest.raises(DeferredInitError, match=re.escape(message)):
        shard_and_materialize(model, mesh)
