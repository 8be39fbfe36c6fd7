"""The strategy's options, checked once when it is constructed, before any process starts.

Every option is keyword-only and of a plain type (so a LightningCLI YAML can set it); a wrong value raises
``TypeError`` or ``ValueError`` naming the option, the value given and what is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_strategy.checkpoint import storage
from fsdp_strategy.host_memory import HOST_MEMORY_MODES
from fsdp_strategy.option_checks import check_positive_int
from fsdp_strategy.sharding.policy import ModulePolicy, PolicyInput, normalize_policy

__all__ = ["HOOK_VIEWS", "STATE_DICT_TYPES", "Options", "check_options"]

STATE_DICT_TYPES = ("auto", "sharded", "full")
HOOK_VIEWS = ("whole", "sharded")


@dataclass(frozen=True)
class Options:
    """The checked options, in the forms the strategy works with (see ``FSDP2Strategy`` for their meaning)."""

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
    state_dict_type: str
    async_save: bool
    init_weights: Path | str | None
    process_group_backend: str | None
    timeout: timedelta
    host_memory: str
    reuse_comm_buffers: bool
    hook_view: str


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
        raise TypeError(f"`host_memory` must be a str, one of {HOST_MEMORY_MODES}; got {host_memory!r} of type"
                        f" {type(host_memory).__name__}.")
    if host_memory not in HOST_MEMORY_MODES:
        raise ValueError(f"`host_memory` must be one of {HOST_MEMORY_MODES}; got {host_memory!r}.")
    if not isinstance(hook_view, str):
        raise TypeError(f"`hook_view` must be a str, one of {HOOK_VIEWS}; got {hook_view!r} of type {type(hook_view).__name__}.")
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
        if not storage.is_url(init_weights) and not Path(init_weights).is_file():
            raise ValueError(f"`init_weights` must name an existing weights file; got '{init_weights}', which is not a file.")
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
        state_dict_type=state_dict_type,
        async_save=async_save,
        init_weights=None if init_weights is None else storage.location(init_weights),
        process_group_backend=process_group_backend,
        timeout=_as_timedelta(timeout),
        host_memory=host_memory,
        reuse_comm_buffers=reuse_comm_buffers,
        hook_view=hook_view,
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
