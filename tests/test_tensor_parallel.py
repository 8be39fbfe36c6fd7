"""``tensor_parallel_size``: the option's checks, the data-parallel mesh shape it leaves, the sampler over
data-parallel ranks, clipping by norm over gradients on several device meshes, the plans applied for a module, and a
single-file checkpoint loaded into a module that holds DTensors from its ``configure_model`` (1-rank gloo group)."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils.data import DataLoader

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.plugins.clipping import clip_grad_norm, total_grad_norm
from fsdp_strategy.sharding.deferred_init import deferred_init, materialize, records_by_name
from fsdp_strategy.sharding.mesh import (
    DATA_PARALLEL_DIM,
    TENSOR_PARALLEL_DIM,
    data_parallel_mesh,
    data_parallel_world,
    tensor_parallel_mesh,
)
from fsdp_strategy.sharding.tensor_parallel import (
    apply_tensor_parallel_plan,
    check_even_split,
    hugging_face_plans,
    plan_layers,
    replicated_module_warning,
)
from testkit import full
from testkit.models import token_dataset
from testkit.tensor_parallel import TensorParallelGPT


@pytest.fixture
def tensor_mesh(single_rank_group):
    """The ``tensor_parallel`` dimension of a (1, 1) ``(data_parallel, tensor_parallel)`` mesh over the one rank."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=(DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM))
    return mesh[TENSOR_PARALLEL_DIM]


def cpu_trainer(**kwargs) -> L.Trainer:
    """A Trainer that is only constructed: no process or process group is started."""
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, '`tensor_parallel_size` must be a positive int or "auto"; got 0.'),
        ("2", TypeError, "`tensor_parallel_size` must be a positive int or \"auto\"; got '2' of type str."),
        ("Auto", TypeError, "`tensor_parallel_size` must be a positive int or \"auto\"; got 'Auto' of type str."),
        (True, TypeError, '`tensor_parallel_size` must be a positive int or "auto"; got True of type bool.'),
    ],
)
def test_a_wrong_tensor_parallel_size_is_refused_with_what_is_accepted(value, error, message):
    with pytest.raises(error, match=re.escape(message)):
        FSDP2Strategy(tensor_parallel_size=value)


def test_tensor_parallelism_that_does_not_divide_a_node_is_refused():
    message = (
        "The device mesh does not fit the world: tensor_parallel_size=3 must divide the devices per node (4) and"
        " the world size (8). Choose a divisor of 4."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        data_parallel_world(8, 3, processes_per_node=4)
    with pytest.raises(ValueError, match=re.escape(message)):
        cpu_trainer(strategy=FSDP2Strategy(tensor_parallel_size=3), devices=4, num_nodes=2)


@pytest.mark.parametrize(
    ("options", "devices", "nodes", "shape"),
    [
        ({"tensor_parallel_size": 2}, 4, 1, (1, 2)),  # 2 data x 2 tensor
        ({"tensor_parallel_size": 4}, 4, 1, (1, 1)),  # tensor parallelism only
        ({"tensor_parallel_size": 2, "hybrid": True}, 4, 2, (2, 2)),  # (replicate, shard, tensor) = (2, 2, 2)
        ({"tensor_parallel_size": 2, "replicate_size": 4}, 2, 4, (4, 1)),
    ],
)
def test_the_data_parallel_mesh_is_the_world_over_the_tensor_parallel_size(options, devices, nodes, shape):
    strategy = cpu_trainer(strategy=FSDP2Strategy(**options), devices=devices, num_nodes=nodes).strategy
    assert strategy.mesh_shape() == shape


@pytest.mark.parametrize(
    ("strategy", "devices", "nodes", "tensor", "shape"),
    [
        ("fsdp2_tp", 4, 1, 4, (1, 1)),  # one node: tensor parallelism only
        ("fsdp2_tp", 2, 3, 2, (1, 3)),  # each node one tensor-parallel group, sharded across the 3 nodes
        ("fsdp2_tp", 1, 2, 1, (1, 2)),
        (FSDP2Strategy(tensor_parallel_size="auto", hybrid=True), 2, 3, 2, (3, 1)),  # replicated across nodes
    ],
)
def test_auto_tensor_parallelism_spans_the_devices_of_a_node(strategy, devices, nodes, tensor, shape):
    # ModelParallelStrategy's defaults: tensor_parallel_size="auto" (devices per node), data_parallel_size="auto"
    # (the nodes).
    built = cpu_trainer(strategy=strategy, devices=devices, num_nodes=nodes).strategy
    assert built.options.tensor_parallel_size == "auto"
    assert built.sharding.tensor_parallel_size(built.num_processes) == tensor
    assert built.mesh_shape() == shape
    assert built.distributed_sampler_kwargs == {"num_replicas": nodes, "rank": 0}


def test_lightning_cli_builds_the_name_and_the_auto_size():
    from lightning.pytorch.cli import LightningCLI

    common = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.num_nodes=2", "--trainer.logger=false"]
    by_name = ["--trainer.strategy=fsdp2_tp"]
    by_class = ["--trainer.strategy=fsdp_strategy.FSDP2Strategy", "--trainer.strategy.tensor_parallel_size=auto"]
    two = ["--trainer.strategy=fsdp_strategy.FSDP2Strategy", "--trainer.strategy.tensor_parallel_size=2"]
    for args, size in ((by_name, "auto"), (by_class, "auto"), (two, 2)):
        cli = LightningCLI(TensorParallelGPT, run=False, args=[*common, *args], save_config_callback=None)
        assert isinstance(cli.trainer.strategy, FSDP2Strategy), args
        assert cli.trainer.strategy.options.tensor_parallel_size == size, args
        assert cli.trainer.strategy.mesh_shape() == (1, 2), args


def test_auto_on_one_device_keeps_both_dimensions_for_a_module_written_for_model_parallel_strategy(trainer_env):
    # The module indexes device_mesh["tensor_parallel"] and ["data_parallel"] in configure_model, as it may under
    # ModelParallelStrategy's "auto" on one device.
    module = TensorParallelGPT("tp_fsdp")
    trainer = cpu_trainer(strategy="fsdp2_tp", devices=1, max_steps=2, enable_checkpointing=False)
    trainer.fit(module, DataLoader(token_dataset(8), batch_size=4))
    assert trainer.strategy.device_mesh.mesh_dim_names == (DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM)
    assert trainer.strategy.device_mesh.shape == (1, 1)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train_loss"])


def test_the_sampler_gives_a_tensor_parallel_group_one_data_parallel_rank():
    strategy = cpu_trainer(strategy=FSDP2Strategy(tensor_parallel_size=2), devices=2, num_nodes=3).strategy
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 0}
    strategy.cluster_environment.set_global_rank(5)  # the last rank of the third node
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 2}


def test_the_mesh_dimensions_fully_shard_and_parallelize_module_take(single_rank_group):
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=(DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM))
    assert data_parallel_mesh(mesh).mesh_dim_names == (DATA_PARALLEL_DIM,)
    assert tensor_parallel_mesh(mesh).mesh_dim_names == (TENSOR_PARALLEL_DIM,)
    plain = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    assert data_parallel_mesh(plain) is plain
    assert tensor_parallel_mesh(plain) is None


def _parameters_on_two_meshes() -> list[nn.Parameter]:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=(DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM))
    generator = torch.Generator().manual_seed(0)
    params = []
    for on, shape in ((mesh, (3, 4)), (mesh[DATA_PARALLEL_DIM], (5,)), (None, (2, 2))):
        value, grad = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        if on is not None:
            placements = [Replicate()] * on.ndim
            value, grad = distribute_tensor(value, on, placements), distribute_tensor(grad, on, placements)
        param = nn.Parameter(value)
        param.grad = grad
        params.append(param)
    return params


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def test_clipping_by_norm_spans_gradients_on_several_meshes(single_rank_group):
    # torch.nn.utils.clip_grad_norm_ stacks DTensors of different meshes, which DTensor refuses.
    params = _parameters_on_two_meshes()
    plain = [nn.Parameter(_plain(p).clone()) for p in params]
    for copy, param in zip(plain, params):
        copy.grad = _plain(param.grad).clone()
    expected = torch.nn.utils.clip_grad_norm_(plain, max_norm=0.5)
    assert total_grad_norm(params) == pytest.approx(float(expected), rel=1e-6)
    assert clip_grad_norm(params, max_norm=0.5) == pytest.approx(float(expected), rel=1e-6)
    for copy, param in zip(plain, params):
        torch.testing.assert_close(_plain(param.grad), copy.grad)
    assert total_grad_norm(params) == pytest.approx(0.5, rel=1e-5)


REPLICATED = (
    "`tensor_parallel_size=4` with no tensor-parallel plan: Sequential holds no DTensor from `configure_model()` and no"
    " Hugging Face model with a `config.base_model_tp_plan`, so it is replicated over the 4 tensor-parallel ranks"
    " (each computes the same batches) and <sharded>. To shard it over all ranks, set `tensor_parallel_size=1`"
    ' (`strategy="fsdp2"` in place of `"fsdp2_tp"`); to split it, split its layers in the LightningModule\'s'
    " `configure_model()`, as for Lightning's ModelParallelStrategy: `parallelize_module(layer,"
    ' self.device_mesh["tensor_parallel"], {"proj_in": ColwiseParallel(), "proj_out": RowwiseParallel()})`'
    " (torch.distributed.tensor.parallel)."
)


@pytest.mark.parametrize(
    ("data_parallel", "sharded"),
    [(1, "not sharded (the data-parallel dimension has 1 rank)"), (2, "sharded over the 2 data-parallel ranks only")],
)
def test_a_module_that_nothing_splits_is_replicated_with_a_warning_naming_the_fixes(
    tensor_mesh, data_parallel, sharded
):
    module = nn.Sequential(nn.Linear(2, 2))
    assert replicated_module_warning(module, 4, data_parallel) == REPLICATED.replace("<sharded>", sharded)
    assert replicated_module_warning(module, 1, data_parallel) is None  # no tensor-parallel ranks to replicate over
    assert apply_tensor_parallel_plan(module, tensor_mesh) == []  # nothing to split, nothing split
    assert not any(isinstance(p, DTensor) for p in module.parameters())


def test_a_module_split_in_configure_model_or_by_a_plan_is_not_warned_about(tensor_mesh):
    split = nn.Sequential(nn.Linear(2, 2))
    parallelize_module(split, tensor_mesh, {"0": ColwiseParallel()})
    assert replicated_module_warning(split, 4, 1) is None
    pytest.importorskip("transformers")
    from testkit.hf import TinyLlama

    assert replicated_module_warning(TinyLlama(), 4, 1) is None  # its base_model_tp_plan splits it


def test_a_hugging_face_plan_is_applied_through_parallelize_module(tensor_mesh):
    pytest.importorskip("transformers")
    from testkit.hf import TinyLlama

    torch.manual_seed(0)
    module = TinyLlama()
    tokens = torch.randint(0, 32, (2, 8))
    expected = module(tokens)
    assert apply_tensor_parallel_plan(module, tensor_mesh) == ["model"]
    split = {name for name, p in module.named_parameters() if isinstance(p, DTensor)}
    assert "model.model.layers.0.self_attn.q_proj.weight" in split
    assert "model.model.layers.1.mlp.down_proj.weight" in split
    assert "model.model.embed_tokens.weight" not in split  # base_model_tp_plan names the layers only
    torch.testing.assert_close(module(tokens), expected)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (
            {"layers.*.mlp.gate_proj": "local_packed_rowwise"},
            "The `base_model_tp_plan` of LlamaModel (model) splits 'layers.*.mlp.gate_proj' as 'local_packed_rowwise',"
            " which this strategy does not apply; it applies 'colwise', 'rowwise', 'colwise_rep', 'rowwise_rep',"
            " 'sequence_parallel'. Split the model in `configure_model()` with `parallelize_module` instead.",
        ),
        (  # torch's parallelize_module only warns, and every rank would train the whole model
            {"blocks.*.attention.wq": "colwise"},
            "`tensor_parallel_size=1`: the `base_model_tp_plan` of LlamaModel (model) names no module of it"
            " (['blocks.*.attention.wq'] ...). Split the model in `configure_model()` with `parallelize_module`, or"
            ' set `tensor_parallel_size=1` (`strategy="fsdp2"` in place of `"fsdp2_tp"`).',
        ),
    ],
    ids=["style-without-a-torch-twin", "names-no-module"],
)
def test_a_plan_this_strategy_cannot_apply_is_refused_by_name(tensor_mesh, plan, message):
    pytest.importorskip("transformers")
    from testkit.hf import TinyLlama

    module = TinyLlama()
    module.model.config.base_model_tp_plan = plan
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_tensor_parallel_plan(module, tensor_mesh)


def test_a_split_that_does_not_divide_the_heads_or_a_layer_is_refused_before_the_first_forward():
    # torch would raise a shape error in the first forward, naming neither the option nor the layer.
    pytest.importorskip("transformers")
    from testkit.hf import TinyLlama

    ((_, base_model, plan),) = hugging_face_plans(TinyLlama())
    layers = plan_layers(base_model, plan, source="TinyLlama's plan", size=4)
    check_even_split(base_model, layers, 2)  # 4 query and 2 key/value heads, even widths: splits
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`tensor_parallel_size=4` does not split LlamaModel evenly: config.num_key_value_heads is 2. Use a"
            " tensor_parallel_size that divides every split dimension and head count (1, 2), or split the model"
            " yourself in `configure_model()`."
        ),
    ):
        check_even_split(base_model, layers, 4)
    # The sizes offered divide every split dimension: 2 would divide 6 but not 9.
    with pytest.raises(
        ValueError, match=re.escape("0.weight dimension 0 (colwise) is 6 (and 1 more). Use") + ".* \\(1, 3\\)"
    ):
        check_even_split(
            nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(4, 9)), {"0": "colwise", "2": "colwise"}, 4
        )
    with pytest.raises(ValueError, match=re.escape("0.weight dimension 1 (rowwise) is 6.")):
        check_even_split(nn.Sequential(nn.Linear(6, 8)), {"0": "rowwise"}, 4)
    with pytest.raises(ValueError, match=re.escape("0.weight dimension 1 (colwise) is 10")):
        check_even_split(nn.Sequential(nn.Embedding(8, 10)), {"0": "colwise"}, 4)


class ShardedInConfigureModel(TensorParallelGPT):
    """Shards itself in ``configure_model``, as for ModelParallelStrategy: it holds DTensors when a checkpoint loads."""

    def configure_model(self) -> None:
        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh)
        fully_shard(self.model, mesh=self.device_mesh)


class FullParamsAtStart(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = {name: p.full_tensor().detach().clone() for name, p in pl_module.named_parameters()}


def test_a_single_file_checkpoint_loads_into_a_module_sharded_in_configure_model(trainer_env, tmp_path):
    loader = DataLoader(token_dataset(8), batch_size=4)
    saving = TensorParallelGPT("none")
    cpu_trainer(devices=1, max_steps=1, enable_checkpointing=False).fit(saving, loader)
    saving.trainer.save_checkpoint(tmp_path / "plain.ckpt")
    trainer_env.fresh()
    resumed = ShardedInConfigureModel()
    trainer = cpu_trainer(
        devices=1, strategy=FSDP2Strategy(), max_steps=2, enable_checkpointing=False, callbacks=[FullParamsAtStart()]
    )
    trainer.fit(resumed, loader, ckpt_path=tmp_path / "plain.ckpt")
    at_start = trainer.callbacks[0].params
    assert at_start.keys() == dict(saving.named_parameters()).keys()
    for name, param in saving.named_parameters():
        assert torch.equal(at_start[name], param.detach()), name
    assert {float(state["step"]) for state in trainer.optimizers[0].state.values()} == {2.0}


def lora_llama(**lora_options):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from testkit.hf import TINY_LLAMA

    torch.manual_seed(0)
    options = {"init_lora_weights": False, **lora_options}  # B random, so that the adapters change the logits
    config = LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "o_proj"], **options)
    return get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)), config)


def test_a_peft_lora_layer_is_split_with_its_base_layer_colwise_by_b_and_rowwise_by_a(tensor_mesh):
    pytest.importorskip("peft")
    module = nn.ModuleDict({"model": lora_llama()})
    tokens = torch.randint(0, 32, (2, 8))
    expected = module["model"](input_ids=tokens).logits
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert apply_tensor_parallel_plan(module, tensor_mesh) == ["model.base_model.model"]
    # The frozen base stays frozen (torch 2.9's styles made every split weight trainable).
    assert {name for name, p in module.named_parameters() if p.requires_grad} == trainable
    split = {name.removeprefix("model.base_model.model.model.layers.0.self_attn.") for name, p in
             module.named_parameters() if isinstance(p, DTensor)}  # fmt: skip
    # A colwise layer's output columns are B's rows; a rowwise layer's input columns are A's columns.
    assert {"q_proj.base_layer.weight", "q_proj.lora_B.default.weight", "k_proj.weight"} <= split
    assert {"o_proj.base_layer.weight", "o_proj.lora_A.default.weight"} <= split
    assert not {"q_proj.lora_A.default.weight", "o_proj.lora_B.default.weight"} & split
    torch.testing.assert_close(module["model"](input_ids=tokens).logits, expected)


def test_a_lora_variant_under_tensor_parallelism_is_refused_naming_the_layer_and_the_fix(tensor_mesh):
    pytest.importorskip("peft")
    message = (
        "`tensor_parallel_size=1`: the plan splits 'layers.0.self_attn.q_proj' as 'colwise', and"
        " peft wrapped it in Linear, which this strategy splits only as a plain LoRA layer of an nn.Linear (no DoRA"
        " or other variant). Leave this layer out of the peft config's `target_modules`, or set"
        ' `tensor_parallel_size=1` (`strategy="fsdp2"` in place of `"fsdp2_tp"`): adapters rarely need tensor'
        " parallelism."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_tensor_parallel_plan(lora_llama(use_dora=True), tensor_mesh)


def test_a_deferred_lora_model_split_by_its_plan_replays_peft_init_on_the_split_shards(single_rank_group):
    # As the strategy does under meta_init: the records are taken before the plan replaces the split weights.
    pytest.importorskip("peft")
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=(DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM))
    eager = lora_llama(init_lora_weights=True)  # peft's own init: B zero
    with deferred_init(torch.device("cpu")):
        deferred = lora_llama(init_lora_weights=True)
    records = records_by_name(deferred)
    apply_tensor_parallel_plan(deferred, mesh[TENSOR_PARALLEL_DIM])
    split = {name for name, param in deferred.named_parameters() if isinstance(param, DTensor)}
    assert {name for name in split if "lora_" in name and "layers.0." in name} == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight",
        "base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight",
    }
    for layer in deferred.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh[DATA_PARALLEL_DIM])
    fully_shard(deferred, mesh=mesh[DATA_PARALLEL_DIM])
    materialize(deferred, torch.device("cpu"), records)

    reference = dict(eager.named_parameters())
    for name, param in deferred.named_parameters():
        values = full(param)
        if "lora_B" in name or "norm" in name:  # zeros, ones: as the eager build, split or not
            assert torch.equal(values, reference[name]), name
        else:  # random: the eager build's scheme (peft's kaiming A, Hugging Face's normal), not its stream
            assert values.std().item() == pytest.approx(reference[name].std().item(), rel=0.25), name
