"""The strategy's options, checked once when it is constructed, before any process starts.

Every option is keyword-only and of a plain type (so a LightningCLI YAML can set it); a wrong value raises
``TypeError`` or ``ValueError`` naming the option, the value given and what is accepted. The options that
name a mode become str-valued enums here, so no other module compares mode strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_strategy.checkpoint import pretrained, storage
from fsdp_strategy.option_checks import check_positive_int
from fsdp_strategy.sharding.policy import ModulePolicy, PolicyInput, normalize_policy

__all__ = [
    "HOOK_VIEWS",
    "NONFINITE_GRADS_MODES",
    "STATE_DICT_TYPES",
    "CheckpointFormat",
    "HookView",
    "HostMemory",
    "NonFiniteGrads",
    "Options",
    "StateDictType",
    "check_nonfinite_grads_option",
    "check_options",
]


class _Mode(str, Enum):
    # Printed and formatted as the plain string the user passed, in messages and logs.
    __str__ = str.__str__
    __format__ = str.__format__


class StateDictType(_Mode):
    AUTO = "auto"  # "full" while rank 0 can hold the whole state, decided when the model is set up
    SHARDED = "sharded"
    FULL = "full"


class CheckpointFormat(_Mode):
    """What the checkpoints are: ``state_dict_type`` with ``"auto"`` decided."""

    SHARDED = "sharded"  # a Distributed Checkpoint directory
    FULL = "full"  # one Lightning checkpoint file


class NonFiniteGrads(_Mode):
    IGNORE = "ignore"
    SKIP = "skip"
    RAISE = "raise"


class HostMemory(_Mode):
    KEEP = "keep"  # leave the allocator alone
    # Hand free heap pages back after sharding (the eager full model freed) and at each phase end of a training
    # step: after forward, after backward, after the optimizer step.
    RELEASE = "release"


class HookView(_Mode):
    WHOLE = "whole"
    SHARDED = "sharded"


STATE_DICT_TYPES = tuple(mode.value for mode in StateDictType)
HOOK_VIEWS = tuple(mode.value for mode in HookView)
HOST_MEMORY_MODES = tuple(mode.value for mode in HostMemory)
NONFINITE_GRADS_MODES = tuple(mode.value for mode in NonFiniteGrads)


def check_nonfinite_grads_option(value: Any) -> str:
    accepted = ", ".join(repr(mode) for mode in NONFINITE_GRADS_MODES)
    if not isinstance(value, str):
        raise TypeError(
            f"`nonfinite_grads` must be one of {accepted} (a str); got {value!r} of type {type(value).__name__}."
        )
    if value not in NONFINITE_GRADS_MODES:
        raise ValueError(f"`nonfinite_grads` must be one of {accepted}; got {value!r}.")
    return value


@dataclass(frozen=True)
class Options:
    """The checked options, in the forms the strategy works with; each is a keyword of ``FSDP2Strategy``:

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
        plain state-dict file) to start from: only rank 0 reads it; every rank receives its shards. Or a
        Hugging Face weights directory (``model.safetensors`` or ``model.safetensors.index.json``, what
        ``save_pretrained`` writes): each rank reads only its shards' rows from the files.
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

    ``cpu_offload`` is kept as the ``offload_policy`` it selects; ``hybrid`` is also implied by a
    ``replicate_size`` above 1; ``state_dict_type="auto"`` writes one file while rank 0 can hold the whole state
    in a quarter of its free host memory, sharded directories beyond that.
    """

    wrap_policy: ModulePolicy | None
    activation_checkpointing_policy: ModulePolicy | None
    reshard_after_forward: bool | int
    hybrid: bool  # also implied by a replicate_size above 1
    replicate_size: int | None
    shard_size: int | None
    offload_policy: OffloadPolicy
    mp_policy: MixedPrecisionPolicy | None
    sync_grads_each_micro_batch: bool
    compile_blocks: bool | str
    meta_init: bool
    state_dict_type: StateDictType
    async_save: bool
    init_weights: Path | str | None
    process_group_backend: str | None
    timeout: timedelta
    nonfinite_grads: NonFiniteGrads
    host_memory: HostMemory
    reuse_comm_buffers: bool
    hook_view: HookView


def check_options(
    *,
    wrap_policy: PolicyInput,
    activation_checkpointing_policy: PolicyInput,
    reshard_after_forward: bool | int,
    hybrid: bool,
    replicate_size: int | None,
    shard_size: int | None,
    cpu_offload: bool,
    mp_policy: MixedPrecisionPolicy | None,
    sync_grads_each_micro_batch: bool,
    compile_blocks: bool | str,
    meta_init: bool,
    state_dict_type: str,
    async_save: bool,
    init_weights: str | Path | None,
    process_group_backend: str | None,
    timeout: float | timedelta,
    nonfinite_grads: str = "ignore",
    host_memory: str = "keep",
    reuse_comm_buffers: bool = True,
    hook_view: str = "whole",
) -> Options:
    for option, value in (
        ("hybrid", hybrid),
        ("cpu_offload", cpu_offload),
        ("sync_grads_each_micro_batch", sync_grads_each_micro_batch),
        ("meta_init", meta_init),
        ("async_save", async_save),
        ("reuse_comm_buffers", reuse_comm_buffers),
    ):
        _check_bool(option, value)
    if not isinstance(compile_blocks, (bool, str)):
        raise TypeError(
            f"`compile_blocks` must be a bool or the name of a torch.compile backend; got {compile_blocks!r}"
            f" of type {type(compile_blocks).__name__}."
        )
    if compile_blocks == "":
        raise ValueError("`compile_blocks` must be a bool or the name of a torch.compile backend; got ''.")
    if not isinstance(reshard_after_forward, bool):
        check_positive_int("reshard_after_forward", reshard_after_forward, accepted="a bool or a positive int")
    for option, size in (("replicate_size", replicate_size), ("shard_size", shard_size)):
        if size is not None:
            check_positive_int(option, size, accepted="a positive int or None")
    if cpu_offload and not torch.cuda.is_available():
        raise ValueError(
            "`cpu_offload=True` (strategy 'fsdp2_offload') needs CUDA: it moves sharded state between"
            " GPU and host memory, and no CUDA device is available here. Use `cpu_offload=False`."
        )
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"`mp_policy` must be a torch.distributed.fsdp.MixedPrecisionPolicy or None; got {mp_policy!r}"
            f" of type {type(mp_policy).__name__}."
        )
    if not isinstance(host_memory, str):
        raise TypeError(
            f"`host_memory` must be a str, one of {HOST_MEMORY_MODES}; got {host_memory!r} of type"
            f" {type(host_memory).__name__}."
        )
    if host_memory not in HOST_MEMORY_MODES:
        raise ValueError(f"`host_memory` must be one of {HOST_MEMORY_MODES}; got {host_memory!r}.")
    if not isinstance(hook_view, str):
        raise TypeError(
            f"`hook_view` must be a str, one of {HOOK_VIEWS}; got {hook_view!r} of type {type(hook_view).__name__}."
        )
    if hook_view not in HOOK_VIEWS:
        raise ValueError(f"`hook_view` must be one of {HOOK_VIEWS}; got {hook_view!r}.")
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"`state_dict_type` must be one of {STATE_DICT_TYPES}; got {state_dict_type!r}.")
    if process_group_backend is not None and not isinstance(process_group_backend, str):
        raise TypeError(
            f"`process_group_backend` must be a str such as 'nccl' or 'gloo', or None; got"
            f" {process_group_backend!r} of type {type(process_group_backend).__name__}."
        )
    if init_weights is not None:
        if not isinstance(init_weights, (str, Path)):
            raise TypeError(f"`init_weights` must be a file path (str) or None; got {init_weights!r}.")
        # A URL is read (and its absence reported on every rank) by rank 0 in setup: checking it here would
        # reach the object store from every process that builds a strategy.
        if pretrained.is_weights_directory(init_weights):
            try:
                pretrained.weight_files(init_weights)
            except ValueError as exc:
                raise ValueError(f"`init_weights`: {exc}") from exc
        elif not storage.is_url(init_weights) and not Path(init_weights).is_file():
            raise ValueError(
                "`init_weights` must name an existing weights file or a Hugging Face weights directory; got"
                f" '{init_weights}', which is neither."
            )
    check_nonfinite_grads_option(nonfinite_grads)
    return Options(
        wrap_policy=normalize_policy(wrap_policy, option="wrap_policy"),
        activation_checkpointing_policy=normalize_policy(
            activation_checkpointing_policy, option="activation_checkpointing_policy"
        ),
        reshard_after_forward=reshard_after_forward,
        hybrid=hybrid or (replicate_size or 1) > 1,
        replicate_size=replicate_size,
        shard_size=shard_size,
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        mp_policy=mp_policy,
        sync_grads_each_micro_batch=sync_grads_each_micro_batch,
        compile_blocks=compile_blocks,
        meta_init=meta_init,
        state_dict_type=StateDictType(state_dict_type),
        async_save=async_save,
        init_weights=None if init_weights is None else storage.location(init_weights),
        process_group_backend=process_group_backend,
        timeout=_as_timedelta(timeout),
        nonfinite_grads=NonFiniteGrads(nonfinite_grads),
        host_memory=HostMemory(host_memory),
        reuse_comm_buffers=reuse_comm_buffers,
        hook_view=HookView(hook_view),
    )


def _check_bool(option: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"`{option}` must be a bool; got {value!r} of type {type(value).__name__}.")


def _as_timedelta(timeout: Any) -> timedelta:
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"`timeout` must be a number of seconds or a datetime.timedelta; got {timeout!r} of type"
            f" {type(timeout).__name__}."
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"`timeout` must be a positive, finite number of seconds; got {seconds}.")
    return timedelta(seconds=seconds)
