"""The strategy's options, each declared once, as a field of :class:`Options`: the plain type and default of
``FSDP2Strategy``'s keyword of that name, its check, and its help text. From that one declaration come the
checked ``Options``, the strategy's docstring (:func:`docstring_args`) and the README's options table
(:mod:`fsdp_strategy.options_table`); a test holds ``FSDP2Strategy.__init__``'s signature to the same names,
defaults and types.

Every option is keyword-only and of a plain type (so a LightningCLI YAML can set it); a wrong value raises
``TypeError`` or ``ValueError`` naming the option, the value given and what is accepted. The options that
name a mode become the str-valued enums of :mod:`fsdp_strategy.modes` here, so no other module compares mode
strings.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_strategy.checkpoint import pretrained
from fsdp_strategy.checkpoint.location import location_of
from fsdp_strategy.modes import CheckpointFormat, HookView, HostMemory, NonFiniteGrads, StateDictType
from fsdp_strategy.option_checks import check_bool, check_positive_int
from fsdp_strategy.sharding.frozen import FROZEN_DTYPES, torchao_to_nf4
from fsdp_strategy.sharding.policy import ModulePolicy, PolicyInput, normalize_policy

__all__ = [
    "OPTIONS",
    "CheckpointFormat",
    "HookView",
    "HostMemory",
    "NonFiniteGrads",
    "OptionSpec",
    "Options",
    "StateDictType",
    "check_nonfinite_grads_option",
    "check_options",
    "docstring_args",
]

_Mode = TypeVar("_Mode", StateDictType, NonFiniteGrads, HostMemory, HookView)


@dataclass(frozen=True)
class OptionSpec:
    """One keyword of ``FSDP2Strategy``, as declared on its field of :class:`Options`."""

    name: str
    accepts: Any  # the keyword's annotation: plain types, as a LightningCLI YAML writes them
    default: Any
    # (value given, option=name) -> the value Options holds; raises TypeError/ValueError naming the option.
    check: Callable[..., Any]
    help: str  # Markdown, one paragraph without the final period: a row of the README's table, an Args entry


def _option(*, accepts: Any, default: Any, check: Callable[..., Any], help: str) -> Any:
    return field(metadata={"option": {"accepts": accepts, "default": default, "check": check, "help": help}})


# --- the checks, each taking the value given and the option's name -------------------------------------------------


def _bool(value: Any, *, option: str) -> bool:
    check_bool(option, value)
    return value


def _bool_or_positive_int(value: Any, *, option: str) -> bool | int:
    if not isinstance(value, bool):
        check_positive_int(option, value, accepted="a bool or a positive int")
    return value


def _positive_int_or_auto(value: Any, *, option: str) -> int | str:
    if value != "auto":
        check_positive_int(option, value, accepted='a positive int or "auto"')
    return value


def _positive_int_or_none(value: Any, *, option: str) -> int | None:
    if value is not None:
        check_positive_int(option, value, accepted="a positive int or None")
    return value


def _mode(value: Any, *, option: str, modes: type[_Mode]) -> _Mode:
    accepted = tuple(mode.value for mode in modes)
    if not isinstance(value, str):
        raise TypeError(f"`{option}` must be a str, one of {accepted}; got {value!r} of type {type(value).__name__}.")
    if value not in accepted:
        raise ValueError(f"`{option}` must be one of {accepted}; got {value!r}.")
    return modes(value)


def check_nonfinite_grads_option(value: Any, *, option: str = "nonfinite_grads") -> NonFiniteGrads:
    # Worded apart from the other modes since its first release; tests/test_guard.py holds these messages.
    accepted = ", ".join(repr(mode.value) for mode in NonFiniteGrads)
    if not isinstance(value, str):
        raise TypeError(f"`{option}` must be one of {accepted} (a str); got {value!r} of type {type(value).__name__}.")
    if value not in {mode.value for mode in NonFiniteGrads}:
        raise ValueError(f"`{option}` must be one of {accepted}; got {value!r}.")
    return NonFiniteGrads(value)


def _offload_needs_cuda(value: Any, *, option: str) -> bool:
    if _bool(value, option=option) and not torch.cuda.is_available():
        raise ValueError(
            f"`{option}=True` (strategy 'fsdp2_offload') needs CUDA: it moves sharded state between"
            f" GPU and host memory, and no CUDA device is available here. Use `{option}=False`."
        )
    return value


def _mp_policy(value: Any, *, option: str) -> MixedPrecisionPolicy | None:
    if value is not None and not isinstance(value, MixedPrecisionPolicy):
        raise TypeError(
            f"`{option}` must be a torch.distributed.fsdp.MixedPrecisionPolicy or None; got {value!r}"
            f" of type {type(value).__name__}."
        )
    return value


def _frozen_dtype(value: Any, *, option: str) -> str | None:
    if value is None:
        return None
    accepted = f"one of {FROZEN_DTYPES} or None"
    if not isinstance(value, str):
        raise TypeError(f"`{option}` must be {accepted}; got {value!r} of type {type(value).__name__}.")
    if value not in FROZEN_DTYPES:
        raise ValueError(f"`{option}` must be {accepted}; got {value!r}.")
    if value == "nf4":
        torchao_to_nf4()  # before any process starts: torchao missing, or not importable with this torch
    return value


def _compile_backend(value: Any, *, option: str) -> bool | str:
    accepted = "a bool or the name of a torch.compile backend"
    if not isinstance(value, (bool, str)):
        raise TypeError(f"`{option}` must be {accepted}; got {value!r} of type {type(value).__name__}.")
    if value == "":
        raise ValueError(f"`{option}` must be {accepted}; got ''.")
    return value


def _backend_name(value: Any, *, option: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"`{option}` must be a str such as 'nccl' or 'gloo', or None; got {value!r} of type {type(value).__name__}."
        )
    return value


def _weights_file(value: Any, *, option: str) -> Path | str | None:
    if value is None:
        return None
    if not isinstance(value, (str, Path)):
        raise TypeError(f"`{option}` must be a file path (str) or None; got {value!r}.")
    # A URL is read (and its absence reported on every rank) by rank 0 in setup: checking it here would
    # reach the object store from every process that builds a strategy.
    where = location_of(value)
    if pretrained.is_weights_directory(value):
        try:
            pretrained.weight_files(value)
        except ValueError as exc:
            raise ValueError(f"`{option}`: {exc}") from exc
    elif not where.remote and not where.is_file():
        raise ValueError(
            f"`{option}` must name an existing weights file or a Hugging Face weights directory; got '{value}',"
            " which is neither."
        )
    return where.value


def _class_names(value: Any, *, option: str) -> tuple[str, ...]:
    accepted = 'a list of optimizer class names (`"MyOptimizer"` or `"my_package.optim.MyOptimizer"`) or None'
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"`{option}` must be {accepted}; got {value!r} of type {type(value).__name__}.")
    for name in value:
        if not isinstance(name, str) or not name:
            raise ValueError(f"`{option}` must be {accepted}; got {value!r}, which holds {name!r}.")
    return tuple(value)


def _seconds(value: Any, *, option: str) -> timedelta:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"`{option}` must be a number of seconds or a datetime.timedelta; got {value!r} of type"
            f" {type(value).__name__}."
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"`{option}` must be a positive, finite number of seconds; got {seconds}.")
    return timedelta(seconds=seconds)


# --- the options --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """The checked options, in the forms the strategy works with; each field is the ``FSDP2Strategy`` keyword
    of its name, declared with what that keyword accepts, its default, its check and what it means.

    ``hybrid`` is also implied by a ``replicate_size`` above 1; ``cpu_offload`` is used as the
    :attr:`offload_policy` it selects.
    """

    wrap_policy: ModulePolicy | None = _option(
        accepts=PolicyInput,
        default="auto",
        check=normalize_policy,
        help='which submodules become sharded units: `"auto"` (a Hugging Face model\'s `_no_split_modules`, else the'
        ' repeated children of each `ModuleList`/`Sequential`), class names (`["Block"]`), module classes'
        " (`{Block}`), a callable `(name, module) -> bool`, a minimum parameter count (`int`), or `None` (no"
        " blocks). Everything else below the LightningModule (embeddings, a final norm, the output head, tied"
        " weights, small heads) is one more unit, a group (`fully_shard([modules])`) gathered once per micro-batch"
        " when its first module runs and kept until backward; the LightningModule, the root unit, keeps only the"
        " parameters registered on itself. Under `*-mixed`, normalization layers are one group of their own kept"
        " in fp32, also gathered once per micro-batch. An explicit policy that matches nothing is an error",
    )
    activation_checkpointing_policy: ModulePolicy | None = _option(
        accepts=PolicyInput,
        default=None,
        check=normalize_policy,
        help='modules whose activations are recomputed in backward, same forms as `wrap_policy` (`"auto"`: the'
        " repeated blocks); `None`: off",
    )
    reshard_after_forward: bool | int = _option(
        accepts=bool | int,
        default=True,
        check=_bool_or_positive_int,
        help="`True` frees each unit's gathered parameters after its forward (ZeRO-3); `False` keeps them gathered"
        " until backward (more memory, fewer all-gathers); an int reshards to that group size (e.g. the"
        " processes per node)",
    )
    hybrid: bool = _option(
        accepts=bool,
        default=False,
        check=_bool,
        help="shard within a node, replicate across nodes (HSDP, a 2-D mesh); also implied by a `replicate_size` above 1",
    )
    replicate_size: int | None = _option(
        accepts=int | None,
        default=None,
        check=_positive_int_or_none,
        help="the mesh's replicating dimension as a plain integer; times `shard_size` it must be the world size, and"
        " either implies the other",
    )
    shard_size: int | None = _option(
        accepts=int | None,
        default=None,
        check=_positive_int_or_none,
        help="the mesh's sharding dimension as a plain integer; times `replicate_size` it must be the world size, and"
        " either implies the other",
    )
    tensor_parallel_size: int | str = _option(
        accepts=int | str,
        default=1,
        check=_positive_int_or_auto,
        help="ranks that split each layer's weights (tensor parallelism), as Lightning's `ModelParallelStrategy`:"
        " above 1 the mesh gains a last `tensor_parallel` dimension and its data-parallel ranks are named"
        " `data_parallel`; the module's `configure_model` applies `parallelize_module` on"
        ' `self.device_mesh["tensor_parallel"]`, or a Hugging Face model inside it is split by its own'
        " `base_model_tp_plan`; the module then stays sharded after the stage, as under `ModelParallelStrategy`."
        " A module that nothing splits is replicated over `tensor_parallel` and sharded over `data_parallel`, with"
        " a warning."
        ' `"auto"` (strategy `"fsdp2_tp"`): the devices of a node, as `ModelParallelStrategy`\'s default, and the'
        " mesh has both dimensions even where that is 1",
    )
    cpu_offload: bool = _option(
        accepts=bool,
        default=False,
        check=_offload_needs_cuda,
        help="offload sharded parameters, gradients and optimizer state to host memory (CUDA only)",
    )
    mp_policy: MixedPrecisionPolicy | None = _option(
        accepts=MixedPrecisionPolicy | None,
        default=None,
        check=_mp_policy,
        help='an explicit `MixedPrecisionPolicy`; only together with `precision="32-true"`',
    )
    frozen_dtype: str | None = _option(
        accepts=str | None,
        default=None,
        check=_frozen_dtype,
        help="the storage dtype of frozen parameters (`requires_grad=False`), set before sharding while trainable"
        ' ones keep theirs: `"bfloat16"` or `"float16"` (half the bytes of fp32; under `*-mixed` they are gathered'
        ' as stored), `"nf4"` frozen `nn.Linear` weights quantized to 4 bits with torchao\'s NF4 tensor (QLoRA; a'
        " weight whose size does not split into whole NF4 blocks per rank stays as built); `None`: as built. See"
        ' "Fine-tuning: frozen and unfrozen parameters"',
    )
    sync_grads_each_micro_batch: bool = _option(
        accepts=bool,
        default=False,
        check=_bool,
        help="reduce-scatter on every micro-batch of gradient accumulation (less memory, more communication); by"
        " default gradients accumulate unsharded and are reduced once per optimizer step. Under hybrid sharding the"
        " all-reduce across replicas still runs once per optimizer step, on the summed shards, so `param.grad` is"
        " written on the last micro-batch only",
    )
    compile_blocks: bool | str = _option(
        accepts=bool | str,
        default=False,
        check=_compile_backend,
        help="`torch.compile` each block selected by `wrap_policy`: `True` with the default backend (inductor), a str"
        " names another backend",
    )
    meta_init: bool = _option(
        accepts=bool,
        default=False,
        check=_bool,
        help="build `configure_model` (and `init_module()`) without allocating parameters, as"
        ' `init_module(empty_init=True)` does; see "Building the model"',
    )
    state_dict_type: StateDictType = _option(
        accepts=str,
        default="auto",
        check=partial(_mode, modes=StateDictType),
        help='`"full"`: one Lightning checkpoint file, as DDP writes; `"sharded"`: a Distributed Checkpoint'
        ' directory; `"auto"`: full while rank 0 holds the whole state with room to spare, sharded beyond;'
        ' `"adapter"`: sharded, without the frozen parameters (a LoRA run saves its adapters and their optimizer'
        ' state); see "Adapter checkpoints"',
    )
    async_save: bool = _option(
        accepts=bool,
        default=False,
        check=_bool,
        help="write checkpoints in the background; the next save waits for the previous one, and a failed write raises",
    )
    init_weights: Path | str | None = _option(
        accepts=str | None,
        default=None,
        check=_weights_file,
        help="a full weights file (Lightning checkpoint or plain state dict) to start from, which only rank 0 reads;"
        " or a Hugging Face weights directory (`model.safetensors` or `model.safetensors.index.json`, what"
        " `save_pretrained` writes), from which each rank reads only its shards' rows",
    )
    process_group_backend: str | None = _option(
        accepts=str | None,
        default=None,
        check=_backend_name,
        help="the backend's name; `None`: `nccl` on CUDA, `gloo` on CPU",
    )
    timeout: timedelta = _option(
        accepts=float | timedelta,
        default=1800,
        check=_seconds,
        help="seconds (or a `timedelta`) the start-up rendezvous and every collective wait for a peer; the error names"
        " the rank (and node) that never arrived or was lost",
    )
    nonfinite_grads: NonFiniteGrads = _option(
        accepts=str,
        default="ignore",
        check=check_nonfinite_grads_option,
        help='NaN/inf in a gradient before an optimizer step: `"ignore"` (no check, no cost), `"skip"` the step with a'
        ' warning, or `"raise"` `NonFiniteGradientError`; see below',
    )
    host_memory: HostMemory = _option(
        accepts=str,
        default="keep",
        check=partial(_mode, modes=HostMemory),
        help='`"release"`: hand freed heap memory back to the system (glibc\'s `malloc_trim`) after sharding and after'
        " each forward, backward and optimizer step, a lower host-memory peak on CPU (0.58x/0.39x DDP's on 2/4"
        " ranks against 0.65x/0.44x for the 116M GPT) for 3-7% more CPU per step (`docs/benchmarks.md`);"
        ' `"keep"`: leave the allocator alone. A no-op where the C library is not glibc; see "Host memory on CPU"',
    )
    reuse_comm_buffers: bool = _option(
        accepts=bool,
        default=True,
        check=_bool,
        help="on CPU, each block's all-gather output and reduce-scatter input come from a pool and are reused instead"
        " of allocated for each collective (same collectives, bitwise the same results; about 15% less CPU per"
        " step on the 116M GPT, nothing measurable on the 11M one); the gradients stay fresh tensors. `False`:"
        " FSDP2's own allocation. No effect on CUDA, where the caching allocator reuses memory",
    )
    hook_view: HookView = _option(
        accepts=str,
        default="whole",
        check=partial(_mode, modes=HookView),
        help="what the hooks that Lightning hands gradients to see: `on_after_backward` and"
        " `on_before_optimizer_step` (of the module or a callback) and `configure_gradient_clipping` (the"
        ' module\'s, and the clipping it calls). `"whole"`, as under DDP, each parameter whole with its whole,'
        " reduced gradient (Lightning's `grad_norm`, clipping read back, NaN checks and comparisons with plain"
        " tensors work unchanged; what the hooks change, clipping included, is written back into the shards); they"
        " are gathered only when such a hook is overridden, one all-gather of parameters and gradients per backward"
        " (`on_after_backward`) and per optimizer step, and their full size in memory for the hook's duration (more"
        ' than half of the free memory is refused before training, naming `"sharded"`). `"sharded"`: the DTensor'
        " shards, nothing gathered (`p.grad.full_tensor()` gathers one). Under both, the LightningModule's"
        " `optimizer_step` sees the shards (its optimizer steps them), and `on_after_backward` of a micro-batch"
        " that accumulates without reducing sees the gradients of the last reduction (`None` after `zero_grad`),"
        " where DDP shows the rank's local sum",
    )

    elementwise_optimizers: tuple[str, ...] = _option(
        accepts=list[str] | None,
        default=None,
        check=_class_names,
        help="optimizer classes, by name, declared to update each element of a parameter from that element alone (and"
        " from scalars every rank shares), as SGD and Adam do, which then step the shards as they are. torch's"
        " elementwise optimizers need no declaring, and `torch.optim.Muon`, `torch.optim.Adafactor` and"
        " transformers' `Adafactor` run distributed, equal to DDP; any other class is refused before training,"
        ' naming this option, since stepping shards of a whole-tensor update trains silently differently. See "Optimizers"',
    )

    @property
    def offload_policy(self) -> OffloadPolicy:
        """``CPUOffloadPolicy`` under ``cpu_offload``; "no offload" is a policy object too."""
        return CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()


OPTIONS: tuple[OptionSpec, ...] = tuple(OptionSpec(name=f.name, **f.metadata["option"]) for f in fields(Options))


def check_options(**given: Any) -> Options:
    """The options given (by name; the others take their defaults) checked into one ``Options``."""
    names = [spec.name for spec in OPTIONS]
    unknown = given.keys() - set(names)
    if unknown:
        raise TypeError(f"check_options() got unknown options {sorted(unknown)}; the options: {', '.join(names)}.")
    held = {spec.name: spec.check(given.get(spec.name, spec.default), option=spec.name) for spec in OPTIONS}
    # The one option implied by another: replicas across nodes are hybrid sharding.
    held["hybrid"] = held["hybrid"] or (held["replicate_size"] or 1) > 1
    return Options(**held)


def docstring_args() -> str:
    """Every option as an ``Args:`` section (Google style, which LightningCLI's docstring parser reads as help)."""
    args = "".join(f"    {spec.name}: {spec.help}.\n" for spec in OPTIONS)
    return f"The options, each checked before any process starts.\n\nArgs:\n{args}"
