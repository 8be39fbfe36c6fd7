"""A stage's sharding of the strategy's module: from the plain module to sharded units, and back.

``ModuleSharding`` builds the stage's device mesh, holds what one stage's sharding leaves behind (the snapshot of
the module before it, the hooks that load full tensors into shards, FSDP2's gathered parameters, the pooled
collective buffers, WeightAveraging's sharded copies) and gives the plain module back after a stage that ended
normally; it answers what the sharding options decide (where ``configure_model`` builds, the parameters hooks see).
``ShardingArguments`` is what the strategy hands it for one stage.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.plugins import LayerSync
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fsdp_strategy import host_memory
from fsdp_strategy._compat import reset_iter_state
from fsdp_strategy.launch.rendezvous import all_ranks_agree
from fsdp_strategy.options import HookView, HostMemory, Options
from fsdp_strategy.sharding import averaging, comm_pool, hook_view, pruning
from fsdp_strategy.sharding.class_names import PlainClassNames
from fsdp_strategy.sharding.deferred_init import (
    deferred_init,
    has_meta_tensors,
    materialize,
    records_by_name,
)
from fsdp_strategy.sharding.frozen import store_frozen
from fsdp_strategy.sharding.mesh import (
    build_device_mesh,
    data_parallel_sampler,
    data_parallel_world,
    resolve_mesh_shape,
    resolve_tensor_parallel_size,
)
from fsdp_strategy.sharding.mixed_precision import mixed_precision_policy
from fsdp_strategy.sharding.parallelize import (
    ShardedUnit,
    apply_activation_checkpointing,
    apply_compile,
    apply_fully_shard,
    load_full_tensors_into_shards,
    plan_units,
)
from fsdp_strategy.sharding.policy import class_name, select_modules
from fsdp_strategy.sharding.tensor_parallel import (
    apply_tensor_parallel_plan,
    is_parallelized,
    refuse_misgathered_strided_shards,
    replicated_module_warning,
)
from fsdp_strategy.sharding.unshard import (
    ShardingSnapshot,
    full_state_bytes,
    gathered_parameters,
    unshard,
)
from fsdp_strategy.sizes import format_bytes
from fsdp_strategy.step.buffer_sync import check_sync_batchnorm, sync_module_states
from fsdp_strategy.step.hooks import StepHooks

__all__ = [
    "SYNC_BUCKET_BYTES",
    "ModuleSharding",
    "ShardingArguments",
    "is_sharded",
    "reshard_after_an_error",
]

SYNC_BUCKET_BYTES = 4 * 1024 * 1024  # larger tensors go alone, without a copy


@dataclass(frozen=True)
class ShardingArguments:
    """What :class:`ModuleSharding` shards a stage's module with, taken from the strategy once in its ``setup()``."""

    precision: Precision  # the Trainer's plugin: it converts the module, and its precision picks the FSDP2 policy
    mesh: DeviceMesh  # the data-parallel dimensions, which fully_shard shards and replicates over
    mesh_shape: tuple[int, int]  # (replicate, shard)
    device: torch.device  # this rank's
    host_group: Any  # the process group of host-side collectives (the buffers' broadcast)
    init_weights: Callable[[nn.Module], None] | None  # loads `init_weights` into the sharded module
    restore: Callable[[], None]  # loads what a checkpoint could not put in before sharding
    tensor_mesh: DeviceMesh | None = None  # the `tensor_parallel` dimension: under tensor_parallel_size > 1 or "auto"


class ModuleSharding:
    """The strategy's module, sharded in ``setup()`` and given back after the stage."""

    def __init__(self, options: Options, *, name: str) -> None:
        self.options = options
        self.name = name  # the strategy's, in messages
        self.mesh: DeviceMesh | None = None  # built when the processes have started
        self.before: ShardingSnapshot | None = None
        self.load_hooks: list[Any] = []
        self.gathered: list[tuple[Tensor, Tensor]] | None = None  # (sharded, FSDP2's gathered) of each parameter
        self.comm_buffers: comm_pool.BufferPool | None = None
        self.averages: averaging.ShardedAverages | None = None  # WeightAveraging's copies, sharded like the module
        self.layer_sync: LayerSync | None = None  # the one applied in setup(), reverted after the stage
        self.class_names = PlainClassNames()  # ModelSummary's layer types as under DDP, for the stage
        # Split over the tensor-parallel ranks, or sharded in `configure_model`: unshard() does not give it back.
        self.parallelized = False

    def __getstate__(self) -> dict[str, Any]:
        # A pickled Trainer leaves out this process's hooks and buffers.
        return {**self.__dict__, "load_hooks": [], "gathered": None, "comm_buffers": None, "averages": None}

    @property
    def offload(self) -> bool:
        return isinstance(self.options.offload_policy, CPUOffloadPolicy)

    def setup(
        self,
        model: nn.Module,
        callbacks: list[Any],
        arguments: ShardingArguments,
        *,
        fitting: bool,
        layer_sync: LayerSync | None,
    ) -> nn.Module:
        """The stage's module, sharded (:meth:`shard`), with WeightAveraging's copy (made in the callback's setup,
        before sharding) sharded the same way."""
        averaging.refuse_stochastic_weight_averaging(callbacks)
        pruning.refuse_model_pruning(callbacks)
        if isinstance(model, FSDPModule):  # a module an earlier stage left sharded (too big to gather), moved to CPU
            self.move_to_device(model, arguments.device)
            sync_module_states(model, host_group=arguments.host_group)  # the buffers; shards cannot disagree
        else:
            if fitting:
                if layer_sync is not None:  # Trainer(sync_batchnorm=True), converted before sharding as DDP does
                    model, self.layer_sync = layer_sync.apply(model), layer_sync
                check_sync_batchnorm(model, arguments.device)
            model = self.shard(model, arguments)
        self.averages = averaging.ShardedAverages.attach(callbacks, model)
        self.class_names.show(model)
        return model

    def after_stage(self, model: nn.Module, *, interrupted: bool) -> nn.Module:
        """As DDP after fit: BatchNorm layers again (a module left sharded keeps its SyncBatchNorm layers:
        replacing a module would detach its parameters from the unit that manages them); after an error, no
        unit left gathered."""
        if self.layer_sync is not None and not is_sharded(model):
            model, self.layer_sync = self.layer_sync.revert(model), None
        if interrupted and isinstance(model, FSDPModule):
            reshard_after_an_error(model)
        self.class_names.restore()
        return model

    def mesh_shape(self, world_size: int, processes_per_node: int) -> tuple[int, int]:
        """``(replicate_size, shard_size)`` of the data-parallel ranks (the world over ``tensor_parallel_size``);
        raises ``ValueError`` when they do not fit."""
        options = self.options
        tensor = self.tensor_parallel_size(processes_per_node)
        per_node = processes_per_node // tensor if options.hybrid else None
        return resolve_mesh_shape(
            data_parallel_world(world_size, tensor, processes_per_node),
            replicate_size=options.replicate_size,
            shard_size=options.shard_size,
            processes_per_node=per_node,
        )

    def init_context(self, device: torch.device, empty_init: bool | None) -> AbstractContextManager[Any]:
        """Where ``configure_model`` builds: Lightning asks with ``empty_init=None``, as DDP builds there, on the
        device for real, unless ``meta_init``; deferred parameters are filled in setup(), one shard per rank."""
        deferred = self.options.meta_init if empty_init is None else empty_init
        return deferred_init(device) if deferred else torch.device(device)

    def view_in_hooks(
        self,
        model: nn.Module,
        owners: tuple[nn.Module | None, list[Any]],
        *,
        fitting: bool,
        device: torch.device,
        processes_per_node: int,
    ) -> hook_view.WholeParameters | None:
        """The whole parameters that the hooks of ``owners`` (the LightningModule, the callbacks) see while fitting
        under ``hook_view="whole"``; ``None``: they see the shards."""
        whole = fitting and self.options.hook_view == HookView.WHOLE and isinstance(model, FSDPModule)
        return hook_view.whole_parameters_in_hooks(model, owners if whole else None, device, processes_per_node)

    def explain(self, exception: BaseException) -> str | None:
        """A note for an error of code that read a shard as a plain tensor under ``hook_view="sharded"``."""
        sharded_view = self.options.hook_view == HookView.SHARDED
        return hook_view.explain_sharded_view(exception) if sharded_view else None

    def tensor_parallel_size(self, processes_per_node: int) -> int:
        """The ranks of a tensor-parallel group, ``"auto"`` resolved to ``processes_per_node``."""
        return resolve_tensor_parallel_size(self.options.tensor_parallel_size, processes_per_node)

    def build_mesh(self, device_type: str, mesh_shape: tuple[int, int], processes_per_node: int) -> DeviceMesh:
        """The stage's mesh, of ``mesh_shape``'s ``(replicate, shard)`` ranks, with a last ``tensor_parallel``
        dimension under ``tensor_parallel_size`` > 1 or ``"auto"``."""
        tensor = self.tensor_parallel_size(processes_per_node)
        # "auto" keeps the dimension where a node has one device: a module written for ModelParallelStrategy
        # indexes `device_mesh["tensor_parallel"]` whatever its size, as it may under that strategy's "auto".
        auto = self.options.tensor_parallel_size == "auto"
        self.mesh = build_device_mesh(device_type, *mesh_shape, tensor if tensor > 1 or auto else None)
        return self.mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError(
                f"{self.name}.device_mesh is available from `setup_environment()` on, e.g. in"
                " `LightningModule.configure_model()`, not before the processes have started."
            )
        return self.mesh

    def sampler_kwargs(self, world_size: int, global_rank: int, processes_per_node: int) -> dict[str, int]:
        """``DistributedSampler``'s arguments: the data-parallel ranks of ``world_size``, ``global_rank``'s one."""
        return data_parallel_sampler(world_size, global_rank, self.tensor_parallel_size(processes_per_node))

    def shard(self, model: nn.Module, arguments: ShardingArguments) -> nn.Module:
        """A plain module sharded: as DDP, every rank starts from rank 0's parameters and buffers, then
        ``arguments.restore`` loads what a checkpoint could not put in before sharding."""
        model = arguments.precision.convert_module(model)
        # Small buckets: a flat copy of 250 MiB (DDP's) would sit on top of the eager full model, at the peak of a run.
        sync_module_states(model, host_group=arguments.host_group, bucket_bytes=SYNC_BUCKET_BYTES)
        self.parallelize(model, arguments)
        arguments.restore()
        if self.options.host_memory == HostMemory.RELEASE:  # the eager full copy was freed when its shards were made
            host_memory.release()
        return model

    def parallelize(self, model: nn.Module, arguments: ShardingArguments) -> None:
        """Activation checkpointing, compile, sharding, then materialization of meta tensors."""
        options, precision, mesh, device = self.options, arguments.precision, arguments.mesh, arguments.device
        # A `tensor_parallel` dimension of 1 ("auto" on one device a node) splits nothing: no plan is needed.
        tensor_parallel = arguments.tensor_mesh is not None and arguments.tensor_mesh.size() > 1
        # Before the plan, not only before fully_shard: parallelize_module wraps each weight it splits in a new
        # Parameter, without the record the old one carried (a split LoRA B got its Linear's init, not peft's zeros).
        deferred = records_by_name(model)
        if tensor_parallel and not is_parallelized(model):
            replicated = replicated_module_warning(model, arguments.tensor_mesh.size(), mesh.size())
            if replicated is not None:
                # Nothing splits it: replicated over `tensor_parallel` (its ranks read the same batches), sharded by
                # fully_shard over the data-parallel mesh only, as under ModelParallelStrategy.
                rank_zero_warn(f"{self.name}: {replicated}")
            else:
                split = apply_tensor_parallel_plan(model, arguments.tensor_mesh)
                rank_zero_info(f"{self.name}: split {', '.join(split) or 'the module'} by its `base_model_tp_plan`")
        self.parallelized = is_parallelized(model)
        if options.frozen_dtype is not None:
            self.store_frozen(model, shards=mesh.size(-1), tensor_parallel=tensor_parallel)
        self.before = ShardingSnapshot(model)
        mp_policy = self.mp_policy(precision)
        keep_norms_fp32 = options.mp_policy is None and mixed_precision_policy(precision.precision) is not None
        units = plan_units(model, options.wrap_policy, mp_policy=mp_policy, keep_norms_fp32=keep_norms_fp32)
        if options.activation_checkpointing_policy is not None:
            apply_activation_checkpointing(select_modules(model, options.activation_checkpointing_policy))
        if options.compile_blocks and options.wrap_policy is not None:
            backend = "inductor" if options.compile_blocks is True else options.compile_blocks
            apply_compile(select_modules(model, options.wrap_policy), backend=backend)
        apply_fully_shard(
            model,
            units,
            mesh,
            root_mp_policy=mp_policy,
            offload_policy=options.offload_policy,
            reshard_after_forward=options.reshard_after_forward,
        )
        refuse_misgathered_strided_shards(model)
        if options.reuse_comm_buffers:
            # Blocks only: they gather every micro-batch; a pooled buffer of the groups kept from forward to
            # backward (the embedding's with them) would stay allocated through the peak for nothing.
            blocks = [unit.module for unit in units if unit.reshard_after_forward is None and len(unit.modules) == 1]
            self.comm_buffers = comm_pool.reuse_buffers(blocks, shards=mesh.size(-1))
        self.before.enable_copies(model)
        self.before.added()
        self.load_hooks = load_full_tensors_into_shards(model)
        was_meta = has_meta_tensors(model)
        materialize(model, torch.device("cpu") if self.offload else device, deferred)
        self.move_to_device(model, device)
        if arguments.init_weights is not None:
            arguments.init_weights(model)
        # FSDP2's gathered Parameter objects, made without gathering where it can: no unit is held whole in setup.
        self.gathered = gathered_parameters(model)
        self.before.pair_gathered(self.gathered)
        self._log(model, units, was_meta, arguments.mesh_shape)

    def store_frozen(self, model: nn.Module, *, shards: int, tensor_parallel: bool) -> None:
        """Frozen parameters in ``frozen_dtype`` before ``fully_shard`` shards them in the dtype it finds."""
        frozen_dtype = self.options.frozen_dtype
        if frozen_dtype == "nf4" and tensor_parallel:
            # torchao's NF4 tensor has no tensor-parallel layout: its blocks would be split across ranks.
            raise ValueError(
                "`frozen_dtype='nf4'` is not supported with `tensor_parallel_size` > 1: NF4 weights cannot be split"
                " over the tensor-parallel ranks. Use `frozen_dtype='bfloat16'` (or `'float16'`), or"
                " `tensor_parallel_size=1`."
            )
        if has_meta_tensors(model):
            # A meta parameter is initialized after sharding, in its sharded dtype: casting it first would
            # initialize a bf16 (or NF4) shard where an eager build initializes fp32 values and then casts.
            raise ValueError(
                f"`frozen_dtype={frozen_dtype!r}` needs the module's parameters built before sharding, and this"
                " module has parameters on the meta device (`meta_init=True` or `init_module(empty_init=True)`)."
                " Build it on the CPU, or leave `frozen_dtype=None` and cast the frozen parameters yourself."
            )
        converted = store_frozen(model, frozen_dtype, shards=shards)
        rank_zero_info(f"{self.name}: {converted} frozen parameters stored as {frozen_dtype}")

    def mp_policy(self, precision: Precision) -> MixedPrecisionPolicy:
        """The policy the units are sharded with: explicit, else derived from ``Trainer(precision=...)``."""
        return self.options.mp_policy or mixed_precision_policy(precision.precision) or MixedPrecisionPolicy()

    def move_to_device(self, model: nn.Module, device: torch.device) -> None:
        if self.offload:
            # Offloaded shards live on the host; buffers are used in compute and go to the device.
            for module in model.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    setattr(module, name, buffer.to(device))
        else:
            model.to(device)

    def _log(self, model: nn.Module, units: list[ShardedUnit], was_meta: bool, mesh_shape: tuple[int, int]) -> None:
        total = sum(p.numel() for p in model.parameters())
        root_params = total - sum(u.num_params for u in units)
        largest = max([(u.num_params, u.name) for u in units] + [(root_params, "<root>")])
        replicate, shard = mesh_shape
        rank_zero_info(
            f"{self.name}: {len(units)} sharded units + root ({class_name(model)}), {total:,} parameters"
            f" on a {'(replicate, shard) = ' + str((replicate, shard)) if replicate > 1 else f'{shard}-way sharded'}"
            f" mesh; largest unit: {largest[1]} ({largest[0]:,} parameters)"
            + ("; materialized from the meta device" if was_meta else "")
        )

    def adopt_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Parameters kept from before sharding (a ``list(self.head.parameters())`` made in ``__init__`` for a
        parameter group of its own) stand for their shards, as under DDP they are the parameters trained."""
        replacements = self.before.replacements() if self.before is not None else {}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [replacements.get(id(p), p) for p in group["params"]]
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if params and not any(isinstance(p, DTensor) for p in params):
                raise ValueError(
                    "The optimizer does not reference any sharded parameter. HINT: create it in"
                    " `configure_optimizers()` from `self.parameters()`, which the strategy calls after sharding."
                )

    def give_back(
        self,
        model: nn.Module,
        optimizers: list[Optimizer],
        hooks: StepHooks,
        *,
        processes_per_node: int,
        device: torch.device,
    ) -> None:
        """After a stage that ended normally, the module the user passed in is plain again, as DDP leaves it: full
        parameters in host memory on every rank, its own class, no sharding hooks (see :mod:`.unshard`); the
        optimizer states stay sharded. It stays sharded where its full parameters do not fit in host memory."""
        if not isinstance(model, FSDPModule) or self.before is None:
            return
        if self.parallelized:
            rank_zero_info(
                f"{self.name}: the module stays sharded after this stage, as Lightning's ModelParallelStrategy leaves"
                " it: it was split over the tensor-parallel ranks, or sharded in its `configure_model`."
            )
            return
        needed = full_state_bytes(model, []) * processes_per_node
        available = host_memory.available()
        if not all_ranks_agree(available is None or needed <= available // 2, device):
            rank_zero_info(
                f"{self.name}: the module stays sharded after this stage: its full parameters"
                f" ({format_bytes(needed)} for the {processes_per_node} processes of a node) do not fit in half of"
                " the free host memory. Every rank must call its forward together; for one process, load a"
                " consolidated checkpoint (`fsdp-strategy consolidate`) into a fresh module."
            )
            return
        for handle in self.load_hooks:
            handle.remove()
        hooks.close(wait=True)  # the unused-parameter hooks sit on the sharded module's gathered parameters
        self.gathered = None  # it holds the shards, which unshard() lets go one by one
        self.comm_buffers = None
        unshard(model, self.before, optimizers, device=torch.device("cpu"))
        self.before, self.load_hooks = None, []
        if self.averages is not None:  # as under DDP, WeightAveraging's copy is whole after the stage too
            self.averages.close()
            self.averages = None


def reshard_after_an_error(model: FSDPModule) -> None:
    """An exception inside a step leaves units gathered, and moving the module (teardown does) expects their
    shards: failing there would hide the user's own error behind FSDP's ("no attribute '_local_tensor'")."""
    try:
        reset_iter_state(model)
    except (AttributeError, RuntimeError):  # the error came before the first forward: nothing was gathered
        pass


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(module, FSDPModule) for module in model.modules())
