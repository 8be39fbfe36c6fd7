"""``FSDP2Strategy``: Lightning's hooks, each delegating to the small modules of this package.

Checkpoints go to :class:`~fsdp_strategy.checkpoint.manager.CheckpointManager`; the device mesh, the module's
sharding and its giving back to :class:`~fsdp_strategy.stage.ModuleSharding`; the end of a stage to
:mod:`~fsdp_strategy.stage_end`; the per-step features to the :class:`~fsdp_strategy.step.hooks.StepHooks` built in
``setup()``; the process group to :class:`~fsdp_strategy.launch.process_group.ProcessGroup`; precision plugins to
:mod:`~fsdp_strategy.plugins.precision`. The options are checked once into ``options``.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

from fsdp_strategy._compat import attached_trainer, set_device_mesh, sync_ddp
from fsdp_strategy.checkpoint.manager import CheckpointManager
from fsdp_strategy.checkpoint.resume_last import ResumingLauncher
from fsdp_strategy.launch import rendezvous
from fsdp_strategy.launch.process_group import ProcessGroup
from fsdp_strategy.optim import ShardedOptimizers
from fsdp_strategy.options import CheckpointFormat, check_options, docstring_args
from fsdp_strategy.plugins import precision as plugins
from fsdp_strategy.sharding import averaging
from fsdp_strategy.sharding.accumulation import accumulation_micro_batch, writes_gradients
from fsdp_strategy.sharding.deferred_init import has_meta_tensors
from fsdp_strategy.sharding.mesh import data_parallel_mesh, tensor_parallel_mesh
from fsdp_strategy.sharding.plan import ShardingPlan
from fsdp_strategy.sharding.policy import PolicyInput
from fsdp_strategy.sharding.unshard import sharded_optimizers
from fsdp_strategy.stage import ModuleSharding, ShardingArguments
from fsdp_strategy.stage_end import end_stage, logged_after_an_error, teardown_keeping_module
from fsdp_strategy.step import unused, whole_reads
from fsdp_strategy.step.features import step_hooks
from fsdp_strategy.step.guard import NonFiniteGuard
from fsdp_strategy.step.hooks import StepHooks
from fsdp_strategy.step.whole_reads import WholeReads, plain_tensors
from fsdp_strategy.strategy_names import register_strategy_names

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FSDP2Strategy", "ShardingPlan"]


class FSDP2Strategy(ParallelStrategy):
    """Fully Sharded Data Parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) for any LightningModule.

    Each rank keeps about 1/N of the parameters, gradients and optimizer state, and gathers a unit's
    full parameters only while it computes. The module needs no changes: repeated blocks are found
    and sharded one by one, the rest of the model below the LightningModule as one group gathered once
    per micro-batch, then the LightningModule itself becomes the root unit.

    Each keyword is one option, declared once on :class:`~fsdp_strategy.options.Options` with its type, default,
    check and meaning; ``__init__``'s docstring lists them all, rendered from there, as does the README.
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
        tensor_parallel_size: int | str = 1,
        cpu_offload: bool = False,
        mp_policy: MixedPrecisionPolicy | None = None,
        frozen_dtype: str | None = None,
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
        elementwise_optimizers: list[str] | None = None,
    ) -> None:
        super().__init__()
        options = self.options = check_options(
            wrap_policy=wrap_policy,
            activation_checkpointing_policy=activation_checkpointing_policy,
            reshard_after_forward=reshard_after_forward,
            hybrid=hybrid,
            replicate_size=replicate_size,
            shard_size=shard_size,
            tensor_parallel_size=tensor_parallel_size,
            cpu_offload=cpu_offload,
            mp_policy=mp_policy,
            frozen_dtype=frozen_dtype,
            sync_grads_each_micro_batch=sync_grads_each_micro_batch,
            compile_blocks=compile_blocks,
            meta_init=meta_init,
            state_dict_type=state_dict_type,
            async_save=async_save,
            init_weights=init_weights,
            process_group_backend=process_group_backend,
            timeout=timeout,
            nonfinite_grads=nonfinite_grads,
            host_memory=host_memory,
            reuse_comm_buffers=reuse_comm_buffers,
            hook_view=hook_view,
            elementwise_optimizers=elementwise_optimizers,
        )
        self.guard = NonFiniteGuard(options.nonfinite_grads)
        self.checkpoints = CheckpointManager(
            self, state_dict_type=options.state_dict_type, async_save=options.async_save, timeout=options.timeout,
            init_weights=options.init_weights,
        )  # fmt: skip
        name = type(self).__name__  # in messages
        self.sharding = ModuleSharding(options, name=name)
        self.processes = ProcessGroup(name=name, timeout=options.timeout, backend=options.process_group_backend)
        self.step_hooks = StepHooks()  # built in setup(), closed in teardown()
        self.optimizer_steps = ShardedOptimizers(options.elementwise_optimizers)
        self._reads = WholeReads()  # around each *_step (see _reading_whole)
        self._in_manual_step = False
        self._in_no_sync = False
        self.num_nodes = 1

    # Each option's meaning, from its one declaration (LightningCLI shows these as the keywords' help).
    __init__.__doc__ = docstring_args()

    @override
    def __getstate__(self) -> dict[str, Any]:
        # A pickled Trainer (`torch.save(trainer)`) leaves out this process's hooks and child processes, as DDP's.
        fresh = ShardedOptimizers(self.options.elementwise_optimizers)
        return {
            **super().__getstate__(),
            "_launcher": None,
            "step_hooks": StepHooks(),
            "optimizer_steps": fresh,
            "_reads": WholeReads(),
        }

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        register_strategy_names(registry, cls)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.sharding.device_mesh

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
        # Across nodes too (the base class counts one node only), over the data-parallel ranks.
        return self.sharding.sampler_kwargs(self.num_nodes * self.num_processes, self.global_rank, self.num_processes)

    @property
    def process_group_backend(self) -> str | None:
        return self.processes.backend

    def mesh_shape(self) -> tuple[int, int]:
        """``(replicate_size, shard_size)`` for the current world; raises ``ValueError`` when they do not fit."""
        return self.sharding.mesh_shape(self.num_nodes * self.num_processes, self.num_processes)

    def _replicated(self) -> bool:
        return self.mesh_shape()[0] > 1

    def sharding_plan(self) -> ShardingPlan:
        """The mesh, resharding and offloading this strategy shards with; ``ValueError`` as :meth:`mesh_shape`."""
        return ShardingPlan(
            self.mesh_shape(),
            self.options.reshard_after_forward,
            cpu_offload=self.sharding.offload,
            sync_grads_each_micro_batch=self.options.sync_grads_each_micro_batch,
            tensor_parallel_size=self.sharding.tensor_parallel_size(self.num_processes),
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
        assert self.cluster_environment is not None and self.lightning_module is not None
        self.checkpoints.begin_stage()
        member = rendezvous.this_member(self.global_rank, self.node_rank, self.local_rank)
        self.processes.start(
            self.cluster_environment, member=member, processes_per_node=self.num_processes, device=self.root_device
        )
        mesh = self.sharding.build_mesh(self.root_device.type, self.mesh_shape(), self.num_processes)
        set_device_mesh(self.lightning_module, mesh)
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:  # before the callbacks' setup(), where WeightAveraging would fail to copy meta tensors
            averaging.refuse_meta_module(trainer.callbacks, self.lightning_module)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.lightning_module is not None:
            self.processes.on_step(self.lightning_module.trainer.global_step)

    @override
    def on_exception(self, exception: BaseException) -> None:
        explained = unused.explain(exception) or self.sharding.explain(exception) or whole_reads.explain(exception)
        self.processes.add_notes(exception, [explained, self.processes.diagnose(exception, rank=self.global_rank)])

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = plugins.FSDP2Precision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None:  # None comes from the base class's __init__, before the options are checked
            plugin = plugins.strategy_plugin(plugin, strategy=type(self).__name__, mp_policy=self.options.mp_policy)
        self._precision_plugin = plugin

    def mp_policy(self) -> MixedPrecisionPolicy:
        """The policy the units are sharded with: explicit, else derived from ``Trainer(precision=...)``."""
        return self.sharding.mp_policy(self.precision_plugin)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        device = self.root_device if self.parallel_devices else torch.device("cpu")
        with self.sharding.init_context(device, empty_init), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        arguments = ShardingArguments(
            precision=self.precision_plugin, mesh=data_parallel_mesh(self.device_mesh), mesh_shape=self.mesh_shape(),
            device=self.root_device, host_group=self.processes.host_group(),
            init_weights=self.checkpoints.init_weights_loader(), restore=self.checkpoints.restore_after_sharding,
            tensor_mesh=tensor_parallel_mesh(self.device_mesh),
        )  # fmt: skip
        layer_sync = self._layer_sync  # type: ignore[attr-defined]
        self.model = self.sharding.setup(
            self.model, trainer.callbacks, arguments, fitting=fitting, layer_sync=layer_sync
        )
        self.checkpoints.setup(self.model)
        self.barrier()
        self.step_hooks.close(wait=False)  # those a failed teardown left
        if fitting:
            self.setup_optimizers(trainer)
        self.step_hooks = step_hooks(
            self.model, fitting=fitting, host_memory=self.options.host_memory, guard=self.guard,
            precision=self.precision_plugin, device=self.root_device, host_group=self.processes.host_group(),
            gathered=self.sharding.gathered,
        )  # fmt: skip
        self.setup_precision_plugin()
        self.precision_plugin.hook_view = self.sharding.view_in_hooks(  # type: ignore[attr-defined]
            self.model, (self.lightning_module, trainer.callbacks), fitting=fitting, device=self.root_device,
            processes_per_node=self.num_processes,
        )  # fmt: skip

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Optimizers built before this setup reference parameters that sharding replaced.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        self.sharding.adopt_optimizers(self.optimizers)
        self.optimizer_steps.release()  # a second fit's optimizers are new ones
        self.optimizer_steps.adopt(self.optimizers)  # before training: an unsupported optimizer is refused here

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        manual = self._in_manual_step = not self.lightning_module.automatic_optimization  # type: ignore[union-attr]
        # DDP's buffer broadcast follows forwards whose gradients it reduces (manual optimization: none).
        gradient_sync = torch.is_grad_enabled() and not manual and not self._in_no_sync
        try:
            self.step_hooks.before_forward()
            with self._reading_whole():
                output = plain_tensors(super().training_step(*args, **kwargs))
            self.step_hooks.after_forward(training=True, gradient_sync=gradient_sync)
            return output
        finally:
            self.step_hooks.after_training_step(manual=manual)
            self._in_manual_step = False

    def _reading_whole(self) -> AbstractContextManager[None]:
        # Off under tensor parallelism, where activations are DTensors meeting plain tensors by design.
        return nullcontext() if self.sharding.parallelized else self._reads.active()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.step_hooks.before_forward()
        with self._reading_whole():
            output = plain_tensors(super().validation_step(*args, **kwargs))
        self.step_hooks.after_forward(training=False, gradient_sync=False)
        return self.step_hooks.after_evaluation_step("validation_step", output)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._reading_whole():
            output = plain_tensors(super().test_step(*args, **kwargs))
        return self.step_hooks.after_evaluation_step("test_step", output)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._reading_whole():
            output = plain_tensors(super().predict_step(*args, **kwargs))
        return self.step_hooks.after_evaluation_step("predict_step", output)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self.step_hooks.before_backward(closure_loss, manual=self._in_manual_step)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        written = writes_gradients(
            final=not self._in_no_sync, sharded=self.options.sync_grads_each_micro_batch, replicated=self._replicated()
        )
        self.step_hooks.after_backward(reduced=written)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped under ``nonfinite_grads="skip"`` because a gradient held NaN or inf."""
        return self.guard.skipped_steps

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        self.optimizer_steps.adopt([optimizer])  # one a callback added after setup
        closure = self.step_hooks.wrap_closure(closure, optimizer, model or self.lightning_module)
        self.step_hooks.before_optimizer_step(manual=self._in_manual_step)
        with self._reads.paused():  # a manual step's optimizer, inside training_step
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.step_hooks.after_optimizer_step(manual=self._in_manual_step)
        return output

    @override
    def model_to_device(self) -> None:
        # parallelize() placed a new module; this brings back one that a teardown moved to CPU.
        assert self.model is not None
        self.sharding.move_to_device(self.model, self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """A non-final micro-batch: no collective (gradients accumulate unsharded), or with
        ``sync_grads_each_micro_batch`` a reduce-scatter, whose all-reduce across replicas waits for the last one."""
        self._in_no_sync = True  # DDP's no_sync(), which also decides its buffer broadcasts
        try:
            sharded, replicated = self.options.sync_grads_each_micro_batch, self._replicated()
            with accumulation_micro_batch(self.model, sharded=sharded, replicated=replicated):
                yield
        finally:
            self._in_no_sync = False

    @override
    def barrier(self, name: str | None = None) -> None:
        self.processes.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.processes.broadcast(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        return sync_ddp(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        """``"sharded"`` (a Distributed Checkpoint directory) or ``"full"`` (one file); ``"auto"`` decided in setup."""
        return self.checkpoints.checkpoint_format

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpoints.model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.checkpoints.optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Saved on every rank together; see :meth:`.CheckpointManager.save`."""
        self.checkpoints.save(checkpoint, filepath, storage_options)

    def wait_for_checkpoint(self) -> None:
        """Blocks until a background save has finished; if it failed on any rank, raises its error on every rank."""
        self.checkpoints.wait()

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Read before the module is sharded, as DDP does; see :meth:`.CheckpointManager.load`."""
        return self.checkpoints.load(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        self.checkpoints.load_model_state(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        self.checkpoints.load_optimizer_states(checkpoint)

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        self.checkpoints.remove(filepath)

    @override
    def teardown(self) -> None:
        trainer = attached_trainer(self.lightning_module) if self.lightning_module is not None else None
        interrupted = trainer is not None and trainer.interrupted
        self.checkpoints.begin_stage()
        plugins.forget_module(self._precision_plugin)
        self.optimizer_steps.release()
        with logged_after_an_error(interrupted, who=f"[rank {self.global_rank}] {type(self).__name__}"):
            end_stage(
                ended_here=trainer is not None and not interrupted, world_size=self.world_size,
                checkpoints=self.checkpoints, step_hooks=self.step_hooks, processes=self.processes,
                give_back=lambda: self.sharding.give_back(
                    self.model, sharded_optimizers(self.optimizers), self.step_hooks,  # type: ignore[arg-type]
                    processes_per_node=self.num_processes, device=self.root_device,
                ),
            )  # fmt: skip
            if self.model is not None:
                self.model = self.sharding.after_stage(self.model, interrupted=interrupted)
            if self.lightning_module is not None and has_meta_tensors(self.lightning_module):
                teardown_keeping_module(self)  # an error came before setup() materialized the module
            else:  # as under DDP: module and optimizer states to CPU (a no-op there), CheckpointIO torn down
                super().teardown()
