"""The private torch and Lightning names this package uses, each with why no public API does the job, and the
public APIs whose spelling differs between the supported releases (torch 2.9 to 2.15, Lightning 2.6).

Everything else in the package uses public torch and Lightning APIs. When one of these changes in a torch
or Lightning release, this is the one file to adapt; ``.ci/torch_matrix`` runs the tests on the oldest and the
newest supported torch. One more private Lightning name is not here because it is a method the package overrides
rather than calls: ``Precision._after_closure`` and ``Precision._clip_gradients`` (Lightning 2.0 to 2.6.6), in
``fsdp_strategy.plugins.precision``, which run ``on_before_optimizer_step`` with whole parameters and clip after it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "FakeTensorMode",
    "FsspecReader",
    "FsspecWriter",
    "ScriptLauncher",
    "averaged_model_of",
    "attached_trainer",
    "TorchDispatchMode",
    "all_gather_single",
    "sync_ddp",
    "disabled_torch_function_impl",
    "flatten_mesh",
    "forget_composable_state",
    "get_layout",
    "is_fake",
    "make_wrapper_subclass",
    "lr_scheduler_aware",
    "muon_functions",
    "op_arguments",
    "reduce_root_gradients_after",
    "reduce_scatter_single",
    "reset_iter_state",
    "set_device_mesh",
    "sharded_units",
    "unsharded_parameters",
    "strided_shard_dim",
    "tensor_version",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
]

# A tensor subclass that handles every op in __torch_dispatch__ sets this as its __torch_function__, as
# torch's own DTensor and FakeTensor do (torch >= 1.13); there is no public spelling.
disabled_torch_function_impl = torch._C._disabled_torch_function_impl

# pytree flattens (args, kwargs) of a dispatched op; torch.utils._pytree is how torch's own tensor
# subclasses do it (torch >= 2.0). Its public twin torch.utils.pytree exists only from torch 2.5 on and
# does not cover every version this package supports.
# Fake tensors carry shapes, dtypes and a device but no memory: the estimator runs a training step on them to
# see which tensors a real step would hold (fsdp_strategy.estimator.peak). FakeTensorMode is what torch.compile
# and torch's memory tools use for that; it lives in torch._subclasses (torch >= 2.0), with no public spelling.
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402

# A mode that sees every aten op, the outputs' storages included, is how memory is counted tensor by tensor
# (fsdp_strategy.estimator.live_tensors). torch's own FlopCounterMode and MemTracker subclass this class; it has lived in
# torch.utils._python_dispatch since torch 1.13, with no public spelling.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten  # noqa: E402


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor, or the class of one."""
    return issubclass(value, FakeTensor) if isinstance(value, type) else isinstance(value, FakeTensor)


def make_wrapper_subclass(cls: type, like: torch.Tensor, *, device: torch.device) -> Any:
    """A tensor of type ``cls`` with ``like``'s geometry and dtype on ``device``, and no memory.

    ``Tensor._make_wrapper_subclass`` is how DTensor and FakeTensor are built (torch >= 1.13); the public
    ``Tensor._make_subclass`` needs real data, which is what a deferred parameter must not allocate.
    """
    return torch.Tensor._make_wrapper_subclass(
        cls,
        like.shape,
        strides=like.stride(),
        storage_offset=like.storage_offset(),
        dtype=like.dtype,
        device=device,
        requires_grad=False,
    )


def op_arguments(op: Any) -> list[Any]:
    """The arguments of an aten op's schema, with their names, ``is_out`` and ``alias_info.is_write``.

    ``OpOverload._schema`` is how torch's own tensor subclasses and FakeTensor find which arguments an op
    writes (torch >= 1.12); there is no public accessor.
    """
    return op._schema.arguments


def tensor_version(tensor: torch.Tensor) -> int:
    """How many in-place writes ``tensor``'s memory has seen.

    ``Tensor._version`` is the counter autograd uses to refuse modified saved tensors (torch >= 0.4);
    there is no public accessor. The strategy uses it the same way: a tensor a deferred parameter copies
    from must not change before the copy is replayed.
    """
    return tensor._version


def forget_composable_state(module: nn.Module) -> None:
    """Lets ``fully_shard`` apply again to a module whose FSDP state was removed.

    torch keeps a global ``WeakKeyDictionary`` from each module to its composable-API state
    (``torch.distributed._composable_state._module_state_mapping``, torch >= 2.1) and refuses to shard a
    module found there ("Inserting ... more than once"). After ``fit`` the strategy gives the user back
    the plain module (see :mod:`fsdp_strategy.sharding.unshard`); ``trainer.test(model)`` then shards it again.
    """
    from torch.distributed import _composable_state

    _composable_state._module_state_mapping.pop(module, None)


# A pickled torch.layout (DCP metadata holds one per tensor) is a call to torch.serialization._get_layout
# with the layout's name, so a restricted unpickler must hand out that function by this name, as torch's own
# weights-only unpickler does (checked with torch 2.13).
get_layout = torch.serialization._get_layout


# Lightning's launcher that starts the other local ranks by re-running the script (what "ddp" uses; torch >= 1.x,
# Lightning >= 2.0). No public class launches processes for a custom ParallelStrategy.
# `Strategy.reduce` must reduce exactly as DDPStrategy.reduce does ("mean" and the other string ops, groups);
# Lightning implements that in this helper (Lightning >= 2.0), which DDPStrategy itself calls.
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp  # noqa: E402
from lightning.pytorch.strategies.launchers.subprocess_script import (  # noqa: E402
    _SubprocessScriptLauncher as ScriptLauncher,
)

# DCP's storage reader and writer over fsspec (s3://, gs://, memory://, ...). torch ships them in
# torch.distributed.checkpoint._fsspec_filesystem (torch >= 2.1, documented there); torch 2.13 no longer
# re-exports them from torch.distributed.checkpoint.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402


def reduce_root_gradients_after(model: nn.Module, loss: torch.Tensor) -> None:
    """Makes the backward of ``loss`` reduce-scatter the gradients of the root unit ``model``'s own parameters.

    FSDP2 reduces gradients in a callback that the pre-backward hook of an FSDP forward's output queues.
    Under manual optimization a loss need not be such an output (a critic trained on detached features,
    whose layers all belong to the root): nothing queues the callback, and the root's gradients would stay
    in its unsharded parameters, unreduced. The root's own pre-backward hook (``FSDPState._pre_backward``,
    torch >= 2.4), registered on the loss, does what the root's forward output would have done; FSDP queues
    its callback once per backward. No public API exists (torch 2.13).
    """
    state = model._get_fsdp_state()  # type: ignore[operator]
    loss.register_hook(state._pre_backward)


def averaged_model_of(callback: Any) -> Any:
    """The ``AveragedModel`` of Lightning's ``WeightAveraging`` callback (``None`` before its ``setup("fit")``).

    Lightning (2.6.0 to 2.6.6) keeps it in ``WeightAveraging._average_model`` and offers no accessor; the
    strategy shards it in place after sharding the module.
    """
    return callback._average_model


def sharded_units(model: nn.Module) -> list[tuple[list[nn.Module], bool]]:
    """The units ``fully_shard`` made below the root ``model``: each unit's modules (several for
    ``fully_shard([a, b])``) and whether it reshards after forward.

    The estimator reads a live model's plan from it. FSDP2 keeps which modules share one unit, and its
    reshard setting, only in its private state (``FSDPModule._get_fsdp_state``, ``FSDPParamGroup.
    post_forward_mesh_info``, torch >= 2.4); no public accessor exists (torch 2.13).
    """
    from torch.distributed.fsdp import FSDPModule

    units: dict[int, tuple[list[nn.Module], bool]] = {}
    for module in model.modules():
        if module is model or not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()  # type: ignore[operator]
        groups = _param_groups(state)
        reshards = any(group.post_forward_mesh_info is not None for group in groups)
        units.setdefault(id(state), ([], reshards))[0].append(module)
    return list(units.values())


def _param_groups(state: Any) -> list[Any]:
    # torch 2.12 made FSDPState._fsdp_param_group (one group or None) a list, _fsdp_param_groups.
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def unsharded_parameters(unit: nn.Module) -> dict[int, nn.Parameter] | None:
    """FSDP2's unsharded parameter of each parameter of the unit ``unit`` belongs to, by the id of its sharded one,
    made without gathering anything; ``None`` where that cannot be done here, and the caller gathers the unit once.

    FSDP2 creates that Parameter at a unit's first all-gather (``FSDPParam.init_unsharded_param``, a view of buffers
    sized by ``FSDPParam.init_all_gather_outputs``) and only refills the same buffers at every later one. Creating it
    through the same two calls, with those buffers allocated and freed untouched, costs no memory, where a real
    all-gather on CPU needs twice the unit's full size on top of the shards (gloo's staging copy, then FSDP2's copy
    out of its flat output). No public API hands out these Parameters (torch 2.9 to 2.15, read in each): the
    ``FSDPParamGroup.lazy_init`` called first is what ``FSDPModule.unshard`` calls first too (it resets the shards
    materialization replaced and decides the gathered dtype). Left to a real all-gather: a parameter whose local
    tensor gathers itself (``fsdp_pre_all_gather``: torchao's NF4), whose buffers it also fills with metadata.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(unit, FSDPModule):
        return None
    try:
        groups = _param_groups(unit._get_fsdp_state())  # type: ignore[operator]
        found: dict[int, nn.Parameter] = {}
        for group in groups:
            group.lazy_init()
            world_size = group._all_gather_process_group.size()
            if any(hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather") for p in group.fsdp_params):
                return None
            for fsdp_param in group.fsdp_params:
                if not hasattr(fsdp_param, "_unsharded_param"):  # not gathered yet
                    inputs = fsdp_param.all_gather_inputs
                    fsdp_param.init_all_gather_outputs(
                        [t.numel() for t in inputs], [t.dtype for t in inputs], world_size, fsdp_param.device
                    )
                    fsdp_param.init_unsharded_param()
                    fsdp_param.free_unsharded_param()
                found[id(fsdp_param.sharded_param)] = fsdp_param._unsharded_param
    except AttributeError:  # a torch whose FSDP2 keeps these elsewhere
        return None
    return found


# The collectives FSDP2 runs by default, for custom ones (fsdp_strategy.sharding.comm_pool). torch 2.13 renamed
# all_gather_into_tensor and reduce_scatter_tensor to *_single and deprecated the old names, which older
# releases have alone.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reset_iter_state(model: nn.Module) -> None:
    """Reshards the units of the root ``model`` and forgets the pass an exception interrupted.

    ``FSDPModule.reset_iter_state`` (public, torch >= 2.13) does it; with an older torch each unit is resharded
    through the public ``FSDPModule.reshard``, which is what moving the module afterwards needs. Errors are
    left to the caller: after an exception this is best effort.
    """
    from torch.distributed.fsdp import FSDPModule

    if hasattr(model, "reset_iter_state"):
        model.reset_iter_state()  # type: ignore[operator]
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def attached_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or ``None``: its ``trainer`` property raises then."""
    return getattr(module, "_trainer", None)


def set_device_mesh(module: Any, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns, set as Lightning's ModelParallelStrategy sets it."""
    module._device_mesh = mesh


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh``'s dimensions as one, reachable from its root mesh as ``root[name]``: the data-parallel group of a
    (replicate, shard, tensor) mesh, which a module written for Lightning's ModelParallelStrategy indexes as
    ``device_mesh["data_parallel"]``. ``DeviceMesh._flatten`` (torch >= 2.6) is how torchtitan names it; torch has no
    public spelling."""
    return mesh._flatten(name)


def strided_shard_dim(placement: Any) -> int | None:
    """The dimension a ``_StridedShard`` placement cuts, or ``None`` for any other placement.

    ``fully_shard`` over a tensor-parallel DTensor that is already split along its own shard dimension (a colwise
    weight: ``Shard(0)`` on ``tensor_parallel``) places the data-parallel cut as ``_StridedShard(0, split_factor)``:
    it cuts each rank's tensor-parallel piece, not the whole tensor. The class is private in every supported torch
    (a ``Shard`` subclass up to 2.9, a C++-backed class of its own since), and both spellings carry ``dim`` and
    ``split_factor``, which is what this reads rather than importing the class.
    """
    if getattr(placement, "split_factor", None) is None:
        return None
    return placement.dim


def lr_scheduler_aware(step: Any, replaced: Any) -> Any:
    """``step``, an optimizer's replacement ``step``, made to look to torch's LR schedulers as the step they wrapped.

    A torch LR scheduler wraps the optimizer's ``step`` on the instance (torch >= 2.2): the wrapper carries
    ``_wrapped_by_lr_sched`` and sets ``optimizer._opt_called``. The scheduler then warns that ``step`` "has been
    overridden after learning rate scheduler initialization" where the attribute is missing, and that
    "lr_scheduler.step()" came before "optimizer.step()" where the flag is unset. The distributed steps of
    :mod:`fsdp_strategy.optim` replace ``replaced`` (the instance's ``step`` before) and keep both; there is no
    public spelling. A torch that names them otherwise only loses the warnings' accuracy.
    """
    if not getattr(replaced, "_wrapped_by_lr_sched", False):
        return step

    def stepped(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(optimizer, *args, **kwargs)

    stepped._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return stepped


def muon_functions() -> tuple[Any, Any, Any]:
    """torch's Newton-Schulz orthogonalization, Muon's learning-rate adjustment and its scalar reader
    (``torch.optim._muon``, torch >= 2.9), which the distributed Muon step calls so that it computes what
    ``torch.optim.Muon`` computes on a whole matrix, bit for bit. Where a torch release moved them, the fallbacks
    hold the same formulas as torch 2.13."""
    try:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
        from torch.optim.optimizer import _to_scalar
    except ImportError:
        return _newton_schulz, _adjust_muon_lr, lambda x: x.item() if isinstance(x, torch.Tensor) else x
    return _zeropower_via_newtonschulz, _adjust_lr, _to_scalar


def _newton_schulz(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Any:
    a, b, c = coefficients
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _adjust_muon_lr(lr: float, adjust_lr_fn: str | None, shape: Any) -> float:
    rows, columns = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * max(1, rows / columns) ** 0.5
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * max(rows, columns) ** 0.5
    return lr
