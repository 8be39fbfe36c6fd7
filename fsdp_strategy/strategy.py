"""``FSDP2Strategy``: Lightning's hooks, each delegating to the small functions of this package."""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from fsdp_strategy import host_memory
from fsdp_strategy._compat import (
    reduce_root_gradients_after,
    reset_iter_state,
    sync_ddp,
)
from fsdp_strategy.checkpoint import background, saving, storage, verify
from fsdp_strategy.checkpoint import io as ckpt
from fsdp_strategy.checkpoint.errors import CheckpointError
from fsdp_strategy.launch import rendezvous
from fsdp_strategy.launch.resume_last import ResumingLauncher
from fsdp_strategy.options import check_options
from fsdp_strategy.sharding import pruning
from fsdp_strategy.sharding.deferred_init import (
    deferred_init,
    has_meta_tensors,
    materialize,
    records_by_name,
)
from fsdp_strategy.sharding.mesh import build_device_mesh, resolve_mesh_shape
from fsdp_strategy.sharding.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fully_shard,
    load_full_tensors_into_shards,
    plan_units,
    reshard_units,
)
from fsdp_strategy.sharding.policy import PolicyInput, class_name, select_modules
from fsdp_strategy.sharding.precision import (
    SUPPORTED_PRECISIONS,
    FSDP2HalfPrecision,
    FSDP2MixedPrecision,
    FSDP2Precision,
    mixed_precision_policy,
    precision_plugin_for,
)
from fsdp_strategy.sharding.unshard import (
    ShardingSnapshot,
    full_state_bytes,
    gathered_parameters,
    unshard,
)
from fsdp_strategy.sizes import format_bytes
from fsdp_strategy.step import averaging, comm_pool, hook_view, unit_order, unused
from fsdp_strategy.step.buffer_sync import (
    BufferSync,
    check_sync_batchnorm,
    sync_module_states,
)
from fsdp_strategy.step.guard import NonFiniteGuard

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FSDP2Strategy", "ShardingPlan"]

_log = logging.getLogger(__name__)

_OUR_PLUGINS = (FSDP2Precision, FSDP2HalfPrecision, FSDP2MixedPrecision)


@dataclass
class _Restore:
    """What a stage restores from the checkpoint ``path`` once the module is sharded."""

    path: Path | str
    files: storage.CheckpointFiles | None = None  # a sharded checkpoint's; its optimizer states are read after setup
    model_state: dict[str, Any] | None = None  # a single file's weights for a module that had no values before sharding
    strict: bool | None = None  # set when the module state is still to be loaded


@dataclass(frozen=True)
class ShardingPlan:
    """How :class:`FSDP2Strategy` shards a model in the current world: what a cost model (the
    estimator, through ``ShardingMonitor``) needs to know besides the model and the Trainer."""

    mesh_shape: tuple[int, int]  # (replicate, shard)
    reshard_after_forward: bool | int
    cpu_offload: bool


class FSDP2Strategy(ParallelStrategy):
    """Fully Sharded Data Parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) for any LightningModule.

    Each rank keeps about 1/N of the parameters, gradients and optimizer state, and gathers a unit's
    full parameters only while it computes. The module needs no changes: repeated blocks are found
    and sharded one by one, the rest of the model below the LightningModule as one group gathered once
    per micro-batch, then the LightningModule itself becomes the root unit.

    Args:
        wrap_policy: which submodules become sharded units (see :mod:`fsdp_strategy.sharding.policy`):
            ``"auto"`` (repeated blocks), class names, module classes, a ``(name, module) -> bool``
            callable, a minimum parameter count, or ``None`` for no blocks (one group holding everything).
        activation_checkpointing_policy: modules whose activations are recomputed in backward, in the
            same forms (``"auto"`` = the repeated blocks). ``None`` turns it off.
        reshard_after_forward: ``True`` frees gathered parameters after each unit's forward (ZeRO-3);
            ``False`` keeps them until backward (ZeRO-2, more memory, fewer all-gathers); an int
            reshards to that smaller group size (e.g. the number of processes per node).
        hybrid: shard within a node and replicate across nodes (HSDP), a 2-D mesh.
        replicate_size, shard_size: the mesh from plain integers; their product must be the world size.
            Either implies the other; a ``replicate_size`` above 1 means hybrid sharding.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (CUDA only).
        mp_policy: an explicit ``MixedPrecisionPolicy``; only with ``Trainer(precision="32-true")``.
        sync_grads_each_micro_batch: reduce-scatter gradients on every micro-batch of gradient
            accumulation. Costs communication but keeps gradients sharded; by default gradients are
            accumulated unsharded and reduced once per optimizer step.
        compile_blocks: ``torch.compile`` each block selected by ``wrap_policy``; ``True`` uses the
            default backend (inductor), a str names another ``torch.compile`` backend.
        meta_init: build the modules created in ``configure_model`` on the meta device and
            initialize them shard by shard with ``reset_parameters()``. Turn off when
            ``configure_model`` loads weights.
        state_dict_type: ``"sharded"`` (a Distributed Checkpoint directory, every rank writes its
            shards) or ``"full"`` (one ordinary Lightning checkpoint file written by rank 0, through
            the Trainer's ``CheckpointIO`` plugin if one is given).
        async_save: write checkpoints in the background while training continues; a new save
            waits for the previous one, and a failed write raises on every rank at the next save or
            at the end.
        init_weights: a full weights file (a consolidated or single-file Lightning checkpoint, or a
            plain state-dict file) to start from. Only rank 0 reads it; every rank receives its shards.
        process_group_backend: ``None`` picks ``"nccl"`` on CUDA and ``"gloo"`` on CPU.
        timeout: seconds (or a ``timedelta``) that the start-up rendezvous and every collective wait for a
            peer before failing. The error names the rank (and node) that never arrived or was lost.
        nonfinite_grads: what to do when a gradient holds NaN or inf before an optimizer step, checked
            on every shard and agreed across ranks: ``"ignore"`` (no check, no cost), ``"skip"``
            (drop that step's gradients so nothing is updated, warn naming the first affected
            parameter, count it in :attr:`skipped_steps`) or ``"raise"`` (``NonFiniteGradientError``
            on every rank). Under ``precision="16-mixed"`` the gradient scaler handles such steps.
        host_memory: ``"release"`` hands freed heap memory back to the system (glibc's ``malloc_trim``)
            after sharding and after each forward, backward and optimizer step: a lower peak of host
            memory on CPU for a few percent more CPU time; ``"keep"`` leaves the allocator alone. A
            no-op where the C library is not glibc.
        reuse_comm_buffers: on CPU, each block's all-gather and reduce-scatter take their flat buffers from a
            pool instead of a fresh allocation each time (the same collectives and results; on the 116M
            benchmark GPT about 15% less CPU time per step). ``False`` allocates each buffer anew, as FSDP2 does.
            Buffers on a GPU are always left to torch's caching allocator.
        hook_view: what ``on_before_optimizer_step`` (of the module or a callback) sees. ``"whole"``: as under
            DDP, whole parameters with their whole, reduced gradients (Lightning's ``grad_norm``, custom clipping,
            NaN checks work unchanged); they are gathered for the hooks, one all-gather of parameters and gradients
            per optimizer step, and only when such a hook is overridden; what the hooks change is written back into
            the shards. ``"sharded"``: the DTensor shards, nothing gathered (``p.grad.full_tensor()`` reads one).
    """

    strategy_name = "fsdp2"

    def __init__(
        self,
        *,
        wrap_policy: PolicyInput = "auto",
        activation_checkpointing_policy: PolicyInput = None,
        reshard_after_forward: bool | int = True,
        hybrid: bool = False,
        replicate_size: int | None = None,
        shard_size: int | None = None,
        cpu_offload: bool = False,
        mp_policy: MixedPrecisionPolicy | None = None,
        sync_grads_each_micro_batch: bool = False,
        compile_blocks: bool | str = False,
        meta_init: bool = False,
        state_dict_type: str = "auto",
        async_save: bool = False,
        init_weights: str | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800,
        nonfinite_grads: str = "ignore",
        host_memory: str = "keep",
        reuse_comm_buffers: bool = True,
        hook_view: str = "whole",
    ) -> None:
        super().__init__()
        options = check_options(
            wrap_policy=wrap_policy,
            activation_checkpointing_policy=activation_checkpointing_policy,
            reshard_after_forward=reshard_after_forward,
            hybrid=hybrid,
            replicate_size=replicate_size,
            shard_size=shard_size,
            cpu_offload=cpu_offload,
            mp_policy=mp_policy,
            sync_grads_each_micro_batch=sync_grads_each_micro_batch,
            compile_blocks=compile_blocks,
            meta_init=meta_init,
            state_dict_type=state_dict_type,
            async_save=async_save,
            init_weights=init_weights,
            process_group_backend=process_group_backend,
            timeout=timeout,
            host_memory=host_memory,
            reuse_comm_buffers=reuse_comm_buffers,
            hook_view=hook_view,
        )
        self._hook_view = options.hook_view
        self._host_memory = options.host_memory
        self._reuse_comm_buffers = options.reuse_comm_buffers
        self._wrap_policy = options.wrap_policy
        self._ac_policy = options.activation_checkpointing_policy
        self._init_weights = options.init_weights
        self._timeout = options.timeout
        self._nonfinite_guard = NonFiniteGuard(nonfinite_grads)
        self._reshard_after_forward = options.reshard_after_forward
        self._hybrid = options.hybrid
        self._replicate_size = options.replicate_size
        self._shard_size = options.shard_size
        self._offload_policy = options.offload_policy
        self._explicit_mp_policy = options.mp_policy
        self._sync_grads_each_micro_batch = options.sync_grads_each_micro_batch
        self._compile_blocks = options.compile_blocks
        self._meta_init = options.meta_init
        self._state_dict_type = state_dict_type
        self._checkpoint_format: str | None = None  # "sharded" or "full": state_dict_type, with "auto" decided in setup()
        self._before_sharding: ShardingSnapshot | None = None
        self._stages_ended = 0  # names each stage's ending in the rendezvous store
        self._load_hooks: list[Any] = []
        self._async_save = options.async_save
        self._saves = background.BackgroundSave()
        self._async_group: Any = None
        self._process_group_backend = options.process_group_backend
        self._device_mesh: DeviceMesh | None = None
        self._in_manual_step = False
        self._in_no_sync = False
        self._layer_sync_applied = False
        self._unused: unused.UnusedParameters | None = None
        self._unit_order: unit_order.UnitOrder | None = None
        self._averages: averaging.ShardedAverages | None = None  # WeightAveraging's copies, sharded like the module
        self._buffer_sync: BufferSync | None = None
        self._comm_buffers: comm_pool.BufferPool | None = None
        self._host_group: Any = None
        self._membership: rendezvous.Membership | None = None
        self._peer_lost = False
        self._restore: _Restore | None = None
        self._gathered: list[tuple[Tensor, Tensor]] | None = None  # (sharded, FSDP2's gathered) of each parameter
        self.num_nodes = 1

    # Runtime handles of this process (store connections, process groups, threads, the launcher's child
    # processes): a pickled Trainer (`torch.save(trainer)`) leaves them out, as DDPStrategy's holds none.
    _PROCESS_LOCAL = (
        "_membership", "_async_group", "_host_group", "_unused", "_unit_order", "_buffer_sync", "_saves", "_launcher",
        "_averages", "_comm_buffers", "_restore", "_gathered",
    )

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in self._PROCESS_LOCAL:
            state[name] = None
        state["_saves"] = background.BackgroundSave()
        return state

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        variants = {
            "fsdp2": ("Fully sharded data parallel (FSDP2, ZeRO-3)", {}),
            "fsdp2_grad_op": ("FSDP2 keeping parameters gathered between forward and backward", {"reshard_after_forward": False}),
            "fsdp2_hybrid": ("FSDP2 sharding within a node and replicating across nodes", {"hybrid": True}),
            "fsdp2_offload": ("FSDP2 with sharded state offloaded to host memory (CUDA)", {"cpu_offload": True}),
            # "fsdp2" always does what DDP needs find_unused_parameters=True for; the name eases the switch.
            "fsdp2_find_unused_parameters_true": ("FSDP2 (parameters unused on some ranks are always handled)", {}),
        }
        for name, (description, init_params) in variants.items():
            registry.register(name, cls, description=description, override=True, **init_params)

    # --- topology ---------------------------------------------------------------------------------

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}.device_mesh is available from `setup_environment()` on, e.g. in"
                " `LightningModule.configure_model()`, not before the processes have started."
            )
        return self._device_mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning injects the DistributedSampler and syncs `self.log(sync_dist=True)` only when this is True.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel rank, across nodes too (the base class counts one node only).
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def mesh_shape(self) -> tuple[int, int]:
        """``(replicate_size, shard_size)`` for the current world; raises ``ValueError`` when they do not fit."""
        return resolve_mesh_shape(
            self.num_nodes * self.num_processes,
            replicate_size=self._replicate_size,
            shard_size=self._shard_size,
            processes_per_node=self.num_processes if self._hybrid else None,
        )

    def sharding_plan(self) -> ShardingPlan:
        """The mesh, resharding and offloading this strategy shards with; ``ValueError`` as :meth:`mesh_shape`."""
        return ShardingPlan(
            mesh_shape=self.mesh_shape(),
            reshard_after_forward=self._reshard_after_forward,
            cpu_offload=isinstance(self._offload_policy, CPUOffloadPolicy),
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.mesh_shape()  # fail on a mesh that cannot fit before any process starts
        # Also under torchrun/SLURM (where it starts nothing): it resolves ckpt_path="last" on URLs.
        self._launcher = ResumingLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        self._peer_lost = False
        self._restore = None
        rendezvous.finish_collectives_at_exit()
        if not _distributed_is_initialized():
            self._membership = self._join_process_group(backend)
        elif self._membership is not None:  # a later fit/validate/test with the same strategy
            self._membership.start()
        self._device_mesh = build_device_mesh(self.root_device.type, *self.mesh_shape())
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        trainer = self.lightning_module._trainer
        if trainer is not None:  # before the callbacks' setup(), where WeightAveraging would fail to copy meta tensors
            averaging.refuse_meta_module(trainer.callbacks, self.lightning_module)

    def _join_process_group(self, backend: str) -> rendezvous.Membership:
        environment = self.cluster_environment
        assert environment is not None
        # Other libraries (and Lightning's own helpers) read the rendezvous address from the environment.
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        membership = rendezvous.join(
            address=environment.main_address,
            port=environment.main_port,
            me=rendezvous.this_member(self.global_rank, self.node_rank, self.local_rank),
            world_size=self.world_size,
            processes_per_node=self.num_processes,
            backend=backend,
            timeout=self._timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )
        if backend == "nccl":  # torch warns about NCCL groups left to exit
            # A plain function, registered once: the handler must not keep this strategy (and its module) alive.
            atexit.unregister(_destroy_process_group_at_exit)
            atexit.register(_destroy_process_group_at_exit)
        rank_zero_info(f"{type(self).__name__}: {self.world_size} processes joined ({backend}).")
        return membership

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._membership is not None and self.lightning_module is not None:
            self._membership.step = self.lightning_module.trainer.global_step

    @override
    def on_exception(self, exception: BaseException) -> None:
        note = unused.explain(exception) or self._explain_sharded_view(exception)
        if note is not None and hasattr(exception, "add_note"):  # Python >= 3.11
            exception.add_note(note)
        elif note is not None:
            _log.error(note)
        # A lost peer surfaces as a transport error ("Connection reset by peer") that names no rank;
        # the heartbeats tell which rank stopped.
        if self._membership is None or not rendezvous.is_communication_failure(exception):
            return
        self._peer_lost = _EXIT.peer_lost = True
        diagnosis = f"{self._membership.diagnose()} {rendezvous.advice()}"
        message = f"[rank {self.global_rank}] {type(self).__name__}: a collective failed. {diagnosis}"
        if hasattr(exception, "add_note"):  # Python >= 3.11 prints notes under the traceback
            exception.add_note(message)
        else:
            _log.error(message)

    def _explain_sharded_view(self, exception: BaseException) -> str | None:
        if self._hook_view != "sharded" or "its data is not allocated yet" not in str(exception):
            return None
        return (
            "Under FSDP2Strategy(hook_view='sharded'), parameters and gradients are DTensor shards, and code written"
            " for plain tensors (Lightning's `grad_norm`, `torch.tensor([...])` of norms) cannot read them. Pass"
            " `hook_view='whole'` to see them whole in `on_before_optimizer_step`, as under DDP, or read"
            " `p.grad.full_tensor()`."
        )

    # --- precision --------------------------------------------------------------------------------

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = FSDP2Precision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is None or isinstance(plugin, _OUR_PLUGINS):
            self._precision_plugin = plugin
            return
        precision = getattr(plugin, "precision", None)
        if type(plugin).__module__.split(".")[:3] != ["lightning", "pytorch", "plugins"]:
            raise TypeError(
                f"{type(self).__name__} does not take custom precision plugins; got {type(plugin).__name__}."
                f" Use `Trainer(precision=...)` with one of: {', '.join(SUPPORTED_PRECISIONS)}, or pass"
                " `mp_policy=` to the strategy."
            )
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"{type(self).__name__} does not support `Trainer(precision={precision!r})`"
                f" ({type(plugin).__name__}). Choose one of: {', '.join(SUPPORTED_PRECISIONS)}."
            )
        if self._explicit_mp_policy is not None and precision != "32-true":
            raise ValueError(
                f"Conflicting precision settings: `mp_policy` was given to {type(self).__name__} and"
                f" `Trainer(precision={precision!r})` too. Pass one of them: keep `mp_policy` with"
                " precision='32-true', or drop `mp_policy`."
            )
        self._precision_plugin = precision_plugin_for(precision, getattr(plugin, "device", self._device_type_guess()))

    def _device_type_guess(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def mp_policy(self) -> MixedPrecisionPolicy:
        """The policy the units are sharded with: explicit, else derived from ``Trainer(precision=...)``."""
        return (
            self._explicit_mp_policy
            or mixed_precision_policy(self.precision_plugin.precision)
            or MixedPrecisionPolicy()
        )

    # --- model setup ------------------------------------------------------------------------------

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Lightning calls this around `configure_model` with `empty_init=None`, as DDP builds there: on the
        # device, for real. Deferred parameters are filled in setup(), after sharding, one shard per rank.
        deferred = self._meta_init if empty_init is None else empty_init
        device = self.root_device if self.parallel_devices else torch.device("cpu")
        with (
            deferred_init(device) if deferred else torch.device(device),
            self.precision_plugin.tensor_init_context(),
        ):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        averaging.refuse_stochastic_weight_averaging(trainer.callbacks)  # type: ignore[attr-defined]
        pruning.refuse_model_pruning(trainer.callbacks)  # type: ignore[attr-defined]
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not isinstance(self.model, FSDPModule):
            if fitting:
                if self._layer_sync:  # Trainer(sync_batchnorm=True), converted before sharding as DDP does
                    self.model = self._layer_sync.apply(self.model)
                    self._layer_sync_applied = True
                check_sync_batchnorm(self.model, self.root_device)
            self.model = self.precision_plugin.convert_module(self.model)
            # As DDP: every rank starts from rank 0's parameters and buffers. Small buckets: a flat copy of
            # 250 MiB (DDP's) would sit on top of the eager full model, at the peak of a sharded run.
            sync_module_states(self.model, host_group=self._gloo_group(), bucket_bytes=SYNC_BUCKET_BYTES)
            self.parallelize(self.model)
            self._restore_after_sharding()
            if self._host_memory == "release":  # the eager full copy was freed when its shards were made
                host_memory.release()
        else:  # a module an earlier stage left sharded (too big to gather), which its teardown moved to CPU
            self.model_to_device()
            sync_module_states(self.model, host_group=self._gloo_group())  # the buffers; shards cannot disagree
        # WeightAveraging copied the module in its setup(), before sharding: its copy is sharded the same way.
        self._averages = averaging.ShardedAverages.attach(trainer.callbacks, self.model)  # type: ignore[attr-defined]
        if self._checkpoint_format is None:
            self._checkpoint_format = self._choose_checkpoint_format(self.model)
        saving.check_checkpoint_io(
            self.checkpoint_io,
            sharded=self._writes_sharded_checkpoints(),
            async_save=self._async_save,
            strategy=type(self).__name__,
        )
        self.barrier()
        if self._unit_order is not None:
            self._unit_order.close()
        self._unit_order = unit_order.UnitOrder.attach(self.model, group=self._gloo_group())
        if fitting:
            self.setup_optimizers(trainer)
            if self._unused is None or self._unused.model is not self.model:
                self._unused = unused.UnusedParameters(self.model, group=self._gloo_group(), gathered=self._gathered)
        self._buffer_sync = BufferSync(self.model) if fitting else None
        self.setup_precision_plugin()
        self.precision_plugin.hook_view = self._whole_parameters_in_hooks(trainer) if fitting else None  # type: ignore[attr-defined]

    def _whole_parameters_in_hooks(self, trainer: pl.Trainer) -> hook_view.WholeParameters | None:
        readers = hook_view.hooks_read_parameters(self.lightning_module, trainer.callbacks)  # type: ignore[arg-type]
        if self._hook_view != "whole" or not readers or not isinstance(self.model, FSDPModule):
            return None
        needed = hook_view.whole_bytes(self.model)
        if self.root_device.type == "cuda":
            free: int | None = torch.cuda.mem_get_info(self.root_device)[0]
        else:
            available = host_memory.available()
            free = None if available is None else available // self.num_processes
        if not rendezvous.all_ranks_agree(free is None or needed <= free // 2, self.root_device):
            raise ValueError(
                f"{', '.join(readers)} overrides `on_before_optimizer_step`, which FSDP2Strategy(hook_view='whole')"
                f" shows whole parameters and gradients, as DDP does: {format_bytes(needed)} on each rank, more than"
                f" half of the {format_bytes(free or 0)} free. Pass `hook_view='sharded'`: the hook then sees DTensor"
                " shards (`p.grad.full_tensor()` gathers one gradient; norms of DTensors are global)."
            )
        return hook_view.WholeParameters(self.model)

    @property
    def checkpoint_format(self) -> str:
        """``"sharded"`` (a Distributed Checkpoint directory) or ``"full"`` (one file): ``state_dict_type``,
        with ``"auto"`` decided when the model is set up."""
        if self._checkpoint_format is None:  # a save before any setup (trainer.strategy.connect(model))
            model = self.model or self.lightning_module
            if model is None:
                return "sharded" if self._state_dict_type == "sharded" else "full"
            self._checkpoint_format = self._choose_checkpoint_format(model)
        return self._checkpoint_format

    def _choose_checkpoint_format(self, model: nn.Module) -> str:
        if self._state_dict_type != "auto":
            return self._state_dict_type
        if not saving.is_default_checkpoint_io(self.checkpoint_io):
            return "full"  # a CheckpointIO plugin writes single files, as it does under DDP
        # "auto": one file, as DDP writes and `load_from_checkpoint` reads, while rank 0 can hold the whole
        # state in host memory with room to spare; Distributed Checkpoint directories beyond that.
        params = {id(p): p for p in model.parameters()}.values()
        estimate = 3 * sum(p.numel() * p.element_size() for p in params)  # weights + two optimizer states
        available = host_memory.available() if self.is_global_zero else None
        chosen = self.broadcast("full" if available is None or estimate <= available // 4 else "sharded")
        rank_zero_info(
            f"{type(self).__name__}: checkpoints are {'single files' if chosen == 'full' else 'sharded directories'}"
            f" (state_dict_type='auto': the full state, about {format_bytes(estimate)} with an optimizer like Adam,"
            f" {'fits' if chosen == 'full' else 'does not fit'} in a quarter of rank 0's free host memory)."
            " Pass state_dict_type='full' or 'sharded' to choose."
        )
        return chosen

    def parallelize(self, model: nn.Module) -> None:
        """Activation checkpointing, compile, sharding, then materialization of meta tensors."""
        self._before_sharding = ShardingSnapshot(model)
        mp_policy = self.mp_policy()
        keep_norms_fp32 = self._explicit_mp_policy is None and mixed_precision_policy(self.precision_plugin.precision) is not None
        units = plan_units(model, self._wrap_policy, mp_policy=mp_policy, keep_norms_fp32=keep_norms_fp32)
        deferred = records_by_name(model)  # fully_shard replaces the parameters that carry them
        if self._ac_policy is not None:
            apply_activation_checkpointing(select_modules(model, self._ac_policy))
        if self._compile_blocks and self._wrap_policy is not None:
            backend = "inductor" if self._compile_blocks is True else self._compile_blocks
            apply_compile(select_modules(model, self._wrap_policy), backend=backend)
        apply_fully_shard(
            model,
            units,
            self.device_mesh,
            root_mp_policy=mp_policy,
            offload_policy=self._offload_policy,
            reshard_after_forward=self._reshard_after_forward,
        )
        if self._reuse_comm_buffers:
            # Blocks only: they gather every micro-batch; a pooled buffer of the groups kept from forward to
            # backward (the embedding's with them) would stay allocated through the peak for nothing.
            blocks = [unit.module for unit in units if unit.reshard_after_forward is None and len(unit.modules) == 1]
            self._comm_buffers = comm_pool.reuse_buffers(blocks, shards=self.device_mesh.size(-1))
        self._before_sharding.enable_copies(model)
        self._before_sharding.added()
        self._load_hooks = load_full_tensors_into_shards(model)
        was_meta = has_meta_tensors(model)
        materialize(model, self._param_device(), deferred)
        self._move_to_device(model)
        self._gathered = gathered_parameters(model)
        self._before_sharding.pair_gathered(self._gathered)
        if self._init_weights is not None and self._restore is None:  # a checkpoint to resume from wins
            self._load_init_weights(model)
        self._log_plan(model, units, was_meta)

    def _load_init_weights(self, model: nn.Module) -> None:
        weights = self._on_rank_zero(
            lambda: ckpt.read_full_weights(self._init_weights),  # type: ignore[arg-type]
            lambda message: ValueError(f"Could not read `init_weights` '{self._init_weights}' on rank 0: {message}"),
        )
        assert self.lightning_module is not None
        ckpt.load_full_weights(model, weights or {}, strict=self.lightning_module.strict_loading)

    def _on_rank_zero(self, action: Callable[[], Any], error: Callable[[str], Exception]) -> Any:
        """Runs ``action`` on rank 0 only (``None`` elsewhere). If it fails, every rank raises
        ``error(message)``: the others would otherwise wait for rank 0 in the next collective."""
        result, message = None, None
        if self.is_global_zero:
            try:
                result = action()
            except Exception as exc:
                message = str(exc)
        message = self.broadcast(message)
        if message is not None:
            raise error(message)
        return result

    def _param_device(self) -> torch.device:
        return torch.device("cpu") if isinstance(self._offload_policy, CPUOffloadPolicy) else self.root_device

    def _log_plan(self, model: nn.Module, units: list, was_meta: bool) -> None:
        total = sum(p.numel() for p in model.parameters())
        root_params = total - sum(u.num_params for u in units)
        largest = max([(u.num_params, u.name) for u in units] + [(root_params, "<root>")])
        replicate, shard = self.mesh_shape()
        rank_zero_info(
            f"{type(self).__name__}: {len(units)} sharded units + root ({class_name(model)}), {total:,} parameters"
            f" on a {'(replicate, shard) = ' + str((replicate, shard)) if replicate > 1 else f'{shard}-way sharded'}"
            f" mesh; largest unit: {largest[1]} ({largest[0]:,} parameters)"
            + ("; materialized from the meta device" if was_meta else "")
        )

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Optimizers built before this setup reference parameters that sharding replaced.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        replacements = self._before_sharding.replacements() if self._before_sharding is not None else {}
        for optimizer in self.optimizers:
            # Parameters kept from before sharding (a `list(self.head.parameters())` made in __init__ for a
            # parameter group of its own) stand for their shards, as under DDP they are the parameters trained.
            for group in optimizer.param_groups:
                group["params"] = [replacements.get(id(p), p) for p in group["params"]]
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if params and not any(isinstance(p, DTensor) for p in params):
                raise ValueError(
                    "The optimizer does not reference any sharded parameter. HINT: create it in"
                    " `configure_optimizers()` from `self.parameters()`, which the strategy calls after sharding."
                )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_manual_step = not self.lightning_module.automatic_optimization  # type: ignore[union-attr]
        # DDP's buffer broadcast follows forwards whose gradients it reduces (manual optimization: none).
        gradient_sync = torch.is_grad_enabled() and not self._in_manual_step and not self._in_no_sync
        try:
            with self._buffer_step(gradient_sync=gradient_sync):
                out = super().training_step(*args, **kwargs)
            if self._host_memory == "release":  # the forward's freed buffers: holes the backward's may not fit
                host_memory.release()
            return out
        finally:
            if self._in_manual_step and isinstance(self.model, FSDPModule):
                reshard_units(self.model)
            self._in_manual_step = False

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._buffer_step(gradient_sync=False):
            output = super().validation_step(*args, **kwargs)
        self._after_evaluation_step("validation_step")
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        self._after_evaluation_step("test_step")
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        self._after_evaluation_step("predict_step")
        return output

    def _after_evaluation_step(self, during: str) -> None:
        if isinstance(self.model, FSDPModule):  # no backward frees the units kept gathered after forward
            reshard_units(self.model)
        self._check_unit_order(during)

    def _check_unit_order(self, during: str) -> None:
        # An evaluation step reduces nothing to carry the digest: one small all-reduce of its own, before its
        # outputs reach the metrics or the caller.
        if self._unit_order is not None:
            self._unit_order.check(during=during)

    @contextmanager
    def _buffer_step(self, *, gradient_sync: bool) -> Generator[None, None, None]:
        if self._buffer_sync is not None:
            self._buffer_sync.before_step()
        yield
        if self._buffer_sync is not None:
            self._buffer_sync.after_step(gradient_sync=gradient_sync)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._in_manual_step and isinstance(self.model, FSDPModule) and closure_loss.requires_grad:
            reduce_root_gradients_after(self.model, closure_loss)
        if self._unit_order is not None:
            self._unit_order.before_backward()
        if self._unused is not None:
            self._unused.before_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._host_memory == "release":
            host_memory.release()
        if self._unit_order is not None:
            self._unit_order.after_backward()
        if self._sync_grads_each_micro_batch or not self._in_no_sync:  # this backward reduced gradients
            if self._unused is not None:  # the units' digest travels in its record
                self._unused.after_backward(order=self._unit_order)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped under ``nonfinite_grads="skip"`` because a gradient held NaN or inf."""
        return self._nonfinite_guard.skipped_steps

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._nonfinite_guard.active:
            module = model or self.lightning_module
            closure = self._nonfinite_guard.wrap(
                closure,
                module,
                optimizer,
                step=module.trainer.global_step,
                device=self.root_device,
                scaler=getattr(self.precision_plugin, "scaler", None),
            )
        if self._in_manual_step and isinstance(self.model, FSDPModule):
            # A unit gathered by a forward without backward would keep its values from before this update.
            reshard_units(self.model)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._host_memory == "release":  # the step's buffers are free now, the next step's not yet taken
            host_memory.release()
        if self._in_manual_step and isinstance(self.model, FSDPModule):
            # The root's own parameters were gathered when training_step began and resharded by the
            # backward that just ran; gather the updated shards so the rest of the step sees them.
            self.model.unshard()
        return output

    @override
    def model_to_device(self) -> None:
        # parallelize() placed a new module; this brings back one that a teardown moved to CPU.
        assert self.model is not None
        self._move_to_device(self.model)

    def _move_to_device(self, model: nn.Module) -> None:
        if isinstance(self._offload_policy, CPUOffloadPolicy):
            # Offloaded shards live on the host; buffers are used in compute and go to the device.
            for module in model.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    setattr(module, name, buffer.to(self.root_device))
        else:
            model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulates gradients locally on non-final micro-batches: one reduce-scatter per optimizer step."""
        self._in_no_sync = True  # DDP's no_sync(), which also decides its buffer broadcasts
        try:
            if self._sync_grads_each_micro_batch or not isinstance(self.model, FSDPModule):
                yield
                return
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        finally:
            self._in_no_sync = False

    # --- collectives ------------------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return sync_ddp(tensor, group, reduce_op=reduce_op)
        return tensor

    # --- checkpoints ------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return ckpt.model_state(self.model, full=self.checkpoint_format == "full")

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        return ckpt.optimizer_state(self.model, optimizer, full=self.checkpoint_format == "full", keep=self.is_global_zero)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None) -> None:
        """Writes the checkpoint aside, then renames it into place once every rank has finished, so a
        crash or a failed write leaves the previous checkpoints intact; a failure on any rank raises
        :class:`~fsdp_strategy.checkpoint.saving.CheckpointSaveError` on every rank. With ``async_save`` the writing
        runs in the background and the next save (or load, or the end of the stage) waits for it.
        Full checkpoints go through the Trainer's ``CheckpointIO`` plugin when one is given, as under DDP."""
        sharded = self._writes_sharded_checkpoints()
        if sharded and storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint does not take `storage_options` for sharded checkpoints; got"
                f" {storage_options!r}. They are meant for a CheckpointIO plugin, which writes single files: pass"
                ' `state_dict_type="full"`.'
            )
        self.wait_for_checkpoint()
        if not sharded:  # sharded state a callback added (WeightAveraging's average), whole in the file as under DDP
            checkpoint = ckpt.gather_dtensors(checkpoint, keep=self.is_global_zero)
        path = storage.location(self.broadcast(str(filepath)))
        token = self.broadcast(saving.staging_token())
        if self.is_global_zero:
            saving.remove_stale_staging(storage.parent(path) if isinstance(path, str) else path.parent)
        in_background = self._saves if self._async_save else None
        if sharded:
            saving.save_sharded(
                checkpoint, path, token, rank=self.global_rank, background=in_background, group=self._checkpoint_group
            )
        elif storage_options is not None or not saving.is_default_checkpoint_io(self.checkpoint_io):
            # The plugin writes the file as under DDP (Lightning's TorchCheckpointIO refuses `storage_options`).
            saving.save_through(self.checkpoint_io, checkpoint, filepath, storage_options, path=path, rank=self.global_rank)
        else:
            live = lambda: background.live_storages(self.model, self._plain_optimizers())  # noqa: E731
            saving.save_full(checkpoint, path, token, rank=self.global_rank, background=in_background, live=live)

    def wait_for_checkpoint(self) -> None:
        """Blocks until a background save has finished; if it failed on any rank, raises its error on every rank."""
        outcome = self._saves.wait()
        if outcome is not None:
            saving.settle(outcome.error, checkpoint=outcome.checkpoint, staging=outcome.staging, rank=self.global_rank)

    def _writes_sharded_checkpoints(self) -> bool:
        return self.checkpoint_format == "sharded"

    def _plain_optimizers(self) -> list[Optimizer]:
        return [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    def _gloo_group(self) -> Any:
        # For small records read on the host (unused parameters): a gloo group keeps them off the GPU streams.
        if torch.distributed.get_backend() == "gloo":
            return None
        if self._host_group is None:
            self._host_group = torch.distributed.new_group(backend="gloo")
        return self._host_group

    def _checkpoint_group(self) -> Any:
        # Background saves talk over their own gloo group, so they never interleave with the
        # training collectives on the default group.
        if self._async_group is None:
            self._async_group = torch.distributed.new_group(backend="gloo", timeout=self._timeout)
        return self._async_group

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Reads a checkpoint before the module is sharded, as DDP does, so that Lightning calls
        ``on_load_checkpoint`` and ``load_state_dict`` in DDP's order: a single file whole on every rank; a sharded
        checkpoint's trainer state, and its module state in full (in place, into the module's own tensors). A module
        built without its values (``meta_init``, ``init_module(empty_init=True)``) gets them after sharding instead:
        each rank reads its shards. Optimizer states are loaded into the sharded optimizers after ``setup``."""
        self.wait_for_checkpoint()
        path = storage.location(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        assert module is not None
        self._restore = _Restore(path)
        if verify.looks_like_sharded_checkpoint(path):
            # None: the user did not choose; torch.load's default since 2.6 is True.
            trusted = weights_only is False

            def check() -> str:
                # On a URL, rank 0 follows the manifest once: every rank reads the files it named then.
                files = storage.checkpoint_files(path)
                verify.verify_sharded_checkpoint(files, weights_only=not trusted)
                return str(files.source)

            # Rank 0 checks every file before any rank unpickles or reads one; a refusal is raised on every rank.
            source = self.broadcast(self._on_rank_zero(check, CheckpointError))
            self._restore.files = storage.files_at(source, name=path)
            whole = not has_meta_tensors(module)
            return ckpt.read_sharded(
                self._restore.files, module, strict=module.strict_loading, weights_only=not trusted, whole=whole
            )
        if saving.is_default_checkpoint_io(self.checkpoint_io):
            return ckpt.read_full_checkpoint(path, weights_only=weights_only)
        source = checkpoint_path if storage.location(checkpoint_path) == path else path
        return ckpt.require_state_dict(self.checkpoint_io.load_checkpoint(source, weights_only=weights_only), path)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        # As DDP, after `on_load_checkpoint`: the module's own `load_state_dict`, before sharding. A module without
        # values yet gets them in setup(), once it is sharded and materialized.
        module = self.lightning_module
        assert module is not None
        if self._restore is not None and has_meta_tensors(module):
            self._restore.model_state, self._restore.strict = checkpoint.get("state_dict"), strict
            return
        if "state_dict" not in checkpoint:
            raise KeyError(
                f"The checkpoint '{self._restore.path if self._restore else ''}' holds no 'state_dict' entry: an"
                " `on_load_checkpoint` hook removed it."
            )
        self._load_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        # As DDP's `optimizer.load_state_dict`: the optimizers are not stepped to create their state first.
        assert self.model is not None
        optimizers = self._sharded_optimizers()
        if self._restore is not None and self._restore.files is not None:
            ckpt.load_sharded_optimizers(self._restore.files, self.model, optimizers, checkpoint["optimizer_states"])
        else:
            ckpt.load_full_optimizers(optimizers, checkpoint.get("optimizer_states", []))

    def _load_state_dict(self, state_dict: dict[str, Any], *, strict: bool) -> None:
        module = self.lightning_module
        assert module is not None
        try:
            module.load_state_dict(state_dict, strict=strict)
        except RuntimeError as error:  # torch's "Error(s) in loading state_dict": name the checkpoint and the keys
            path = self._restore.path if self._restore is not None else "<checkpoint>"
            ckpt.check_full_state_dict(module, state_dict, strict=strict, path=path)
            raise error

    def _restore_after_sharding(self) -> None:
        """Loads the module state that a module without values could not take before it was sharded."""
        restore, module = self._restore, self.lightning_module
        if restore is None or module is None:
            return
        if restore.model_state is not None:
            self._load_state_dict(restore.model_state, strict=bool(restore.strict))  # each rank keeps its shards
        elif restore.files is not None and restore.strict is not None:
            ckpt.load_sharded_model(restore.files, module, strict=restore.strict)
        restore.model_state, restore.strict = None, None

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        if self.is_global_zero:
            # Not before the save in the background that replaces it is in place.
            self._saves.defer_removal(filepath, saving.remover(self.checkpoint_io))

    @override
    def teardown(self) -> None:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        self._restore = None
        if isinstance(self._precision_plugin, _OUR_PLUGINS):
            self._precision_plugin.hook_view = None  # it holds the module
        if trainer is None or not trainer.interrupted:
            self._teardown(trainer)
            return
        try:
            self._teardown(trainer)
        except Exception as error:  # noqa: BLE001  (Lightning re-raises the user's error after this: keep it in view)
            _log.warning(f"[rank {self.global_rank}] {type(self).__name__}: teardown after the error above failed too: {error!r}")

    def _teardown(self, trainer: pl.Trainer | None) -> None:
        # Settling a save and gathering the module are collectives: only when every rank ended the stage
        # normally (an exception on one rank alone, e.g. in a rank-0-only callback, leaves the others here).
        ended = not self._peer_lost and self._stage_ended_on_every_rank(trainer)
        if ended:
            self.wait_for_checkpoint()
            if self._unused is not None:
                self._unused.wait()
            self._give_back_plain_module()
        # The per-step trackers go with the stage, also when it failed or the module stays sharded: the unused-
        # parameter hooks would otherwise keep the module alive after its Trainer (a later setup makes new ones).
        if self._unused is not None:
            self._unused.close(wait=ended)
            self._unused = None
        if self._unit_order is not None:
            self._unit_order.close()
            self._unit_order = None
        if not self._peer_lost:
            self._saves.close()
        if self._membership is not None:
            self._membership.stop()
        if self._layer_sync_applied and self._layer_sync and self.model is not None and not _is_sharded(self.model):
            # As DDP after fit: BatchNorm layers again. A module left sharded keeps its SyncBatchNorm layers:
            # replacing a module would detach its parameters from the unit that manages them.
            self.model = self._layer_sync.revert(self.model)
            self._layer_sync_applied = False
        if trainer is not None and trainer.interrupted and isinstance(self.model, FSDPModule):
            _reshard_after_an_error(self.model)
        if self.lightning_module is not None and has_meta_tensors(self.lightning_module):
            # An error came before setup() materialized the module (WeightAveraging's refusal): there is nothing
            # to move, and moving meta tensors would raise over that error. The rest of the base teardown:
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        # As under DDP, this moves the module and optimizer states to CPU (a no-op on a CPU accelerator;
        # the module is plain again by now unless it was too big) and tears down the CheckpointIO plugin.
        super().teardown()

    def _stage_ended_on_every_rank(self, trainer: pl.Trainer | None) -> bool:
        ended_here = trainer is not None and not trainer.interrupted
        if self._membership is None or self.world_size == 1:  # a process group this strategy did not join
            return ended_here
        self._stages_ended += 1
        return self._membership.all_ok(f"stage_end/{self._stages_ended}", ended_here, timeout=self._timeout.total_seconds())

    def _sharded_optimizers(self) -> list[Optimizer]:
        """The optimizers of the current sharded model (a stage after fit keeps fit's optimizers, whose
        parameters were given back in full)."""
        return [o for o in self._plain_optimizers() if any(isinstance(p, DTensor) for g in o.param_groups for p in g["params"])]

    def _give_back_plain_module(self) -> None:
        """After a stage that ended normally, the module the user passed in is plain again, as DDP leaves it:
        full parameters in host memory on every rank, its own class, no sharding hooks (see :mod:`fsdp_strategy.sharding.unshard`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not isinstance(self.model, FSDPModule) or self._before_sharding is None or trainer is None or trainer.interrupted:
            return
        optimizers = self._sharded_optimizers()
        needed = full_state_bytes(self.model, []) * self.num_processes  # the optimizer states stay sharded
        available = host_memory.available()
        if not rendezvous.all_ranks_agree(available is None or needed <= available // 2, self.root_device):
            rank_zero_info(
                f"{type(self).__name__}: the module stays sharded after this stage: its full parameters"
                f" ({format_bytes(needed)} for the {self.num_processes} processes of a node) do not fit in half of"
                " the free host memory. Every rank must call its forward together; for one process, load a"
                " consolidated checkpoint (`fsdp-strategy consolidate`) into a fresh module."
            )
            return
        for handle in self._load_hooks:
            handle.remove()
        if self._unused is not None:  # its hooks sit on the sharded module's gathered parameters
            self._unused.close()
            self._unused = None
        if self._unit_order is not None:
            self._unit_order.close()
            self._unit_order = None
        self._gathered = None  # it holds the shards, which unshard() lets go one by one
        self._comm_buffers = None
        unshard(self.model, self._before_sharding, optimizers, device=torch.device("cpu"))
        self._before_sharding, self._load_hooks = None, []
        if self._averages is not None:  # as under DDP, WeightAveraging's copy is whole after the stage too
            self._averages.close()
            self._averages = None


SYNC_BUCKET_BYTES = 4 * 1024 * 1024  # larger tensors go alone, without a copy


def _reshard_after_an_error(model: FSDPModule) -> None:
    """An exception inside a step leaves units gathered, and moving the module (teardown does) expects their
    shards: failing there would hide the user's own error behind FSDP's ("no attribute '_local_tensor'")."""
    try:
        reset_iter_state(model)
    except (AttributeError, RuntimeError):  # the error came before the first forward: nothing was gathered
        pass


def _is_sharded(model: nn.Module) -> bool:
    return any(isinstance(module, FSDPModule) for module in model.modules())


def _distributed_is_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@dataclass
class _ExitState:
    peer_lost: bool = False  # in any fit of this process: destroying the group could then block


_EXIT = _ExitState()


def _destroy_process_group_at_exit() -> None:
    if not _EXIT.peer_lost:
        _destroy_process_group()


def _destroy_process_group() -> None:
    if _distributed_is_initialized():
        torch.distributed.destroy_process_group()
