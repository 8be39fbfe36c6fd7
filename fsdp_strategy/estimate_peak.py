"""The per-rank peak of a training step, activations included: one step run on fake tensors, replayed per plan.

:func:`trace_step` runs the LightningModule's own ``training_step`` and the backward of its loss once, on fake
tensors (shapes and dtypes, no memory, no process group), the way Lightning runs them: under autocast for
``*-mixed``, with the strategy's activation checkpointing when a policy is given, the previous step's gradients
alive until ``zero_grad`` just before backward. A :class:`~fsdp_strategy.live_tensors.LiveTensors` mode counts
op by op the bytes of every tensor that is neither a parameter, a buffer nor a parameter's gradient (saved
activations, temporaries, gradients of activations, the batch), and hooks record when each unit of the
sharding plan (:func:`fsdp_strategy.estimate.plan_groups`) starts and ends its forward and its backward and when
each parameter's gradient appears.

:func:`step_peak` replays that record for one strategy and world size. The plan's units say what FSDP2 adds
at each moment: a unit's gathered parameters from its forward until it reshards (``fsdp2``: right after its
forward, again from its backward on, the next unit prefetched; ``fsdp2_grad_op``: until its backward ends; the
root for the whole step), the gathering buffer while a unit is gathered, the unit's unsharded gradients until
its reduce-scatter, that reduce-scatter's input (held until the next one) and the sharded gradients it leaves.
DDP holds full parameters, gradients and a gradient bucket of their size. The optimizer step adds Adam's
per-parameter temporaries. The largest total is the peak.

Parameters under ``*-mixed`` are traced in the dtype the strategy computes with: FSDP2 gathers them in bf16
(norm units in fp32) and casts a unit's inputs to it, while DDP keeps fp32 weights and autocast makes the
low-precision copies, which the trace counts as activations. Autocast follows CPU rules (the trace runs on
fake CPU tensors), so a CUDA run may keep a few ops in another dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fsdp_strategy._compat import FakeTensorMode, is_fake, tree_flatten, tree_map
from fsdp_strategy.estimate import Estimate, _Group, _shard_numel, _sizes
from fsdp_strategy.live_tensors import OTHER, LiveTensors
from fsdp_strategy.parallelize import apply_activation_checkpointing
from fsdp_strategy.policy import ModulePolicy, class_name, select_modules
from fsdp_strategy.precision import precision_plugin_for

__all__ = ["StepPeak", "StepTrace", "step_peak", "token_batch", "trace_step"]

# Lightning's fit loop fetches the next batch before it runs the current one (to know whether it is the last).
_BATCHES_HELD = 2
# Adam(W)'s single-tensor step (torch's default for CPU tensors) holds up to three temporaries of the
# parameter it updates (measured on torch 2.13: sqrt, the division by the bias correction, the update).
_ADAM_TEMPORARIES = 3
_LOW_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
               "16-true": torch.float16}


@dataclass(frozen=True)
class StepTrace:
    """What one traced training step held besides the model state, op by op.

    ``records`` holds, in order, ints (bytes of activations and temporaries after an op) and events:
    ``("fw", unit)``/``("fw_end", unit)`` around a unit's forward, ``("bw", unit)`` when its backward
    starts, ``("bw_end", unit)`` when the gradients of its inputs are done, ``("grad", param, bytes)``
    when a parameter's gradient appears, and ``("backward",)`` where Lightning zeroes the gradients
    and calls backward.
    """

    records: list[Any]
    batch_bytes: int
    buffer_bytes: int
    units: tuple[str, ...]  # units in the order their forward ran (FSDP2 prefetches backward in reverse)
    batch_size: int
    activation_checkpointing: str | None


@dataclass(frozen=True)
class StepPeak:
    """The largest bytes of live tensors one rank holds during a step, what activations made of them, and when."""

    bytes: int
    activation_bytes: int
    moment: str


def token_batch(batch_size: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """``(tokens, targets)``, two int64 tensors of shape ``(batch_size, seq_len)``: a language model's batch."""
    return torch.zeros(batch_size, seq_len, dtype=torch.long), torch.zeros(batch_size, seq_len, dtype=torch.long)


# --- tracing --------------------------------------------------------------------------------------------------


def trace_step(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    *,
    batch_size: int,
    precision: str,
    groups: Sequence[_Group],
    sharded: bool,
    activation_checkpointing: ModulePolicy | None = None,
) -> StepTrace:
    """Runs ``model.training_step`` and backward once on fake tensors and records what it holds (see the module).

    ``model`` is consumed: its parameters and buffers are replaced by fake ones (build it on the meta device
    for this). ``groups`` is the plan of the strategy traced for (``sharded``: FSDP2's units, whose parameters
    are traced in their compute dtype; otherwise DDP's, fp32 weights cast by autocast). ``make_batch(n)``
    returns a batch of ``n`` samples, its tensors created on the fly (they come out fake).

    Raises:
        ValueError: the step cannot run on fake tensors without a Trainer (its message says why).
    """
    low = _LOW_DTYPES.get(precision)
    mixed = precision.endswith("-mixed")
    dtypes = _traced_dtypes(groups, low, precision, sharded)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    records: list[Any] = []
    live = LiveTensors(fake=True, on_op=lambda live, _: _note(records, live.by_category.get(OTHER, 0)))
    with fake_mode:
        params, buffers = _fake_state(model, dtypes, low if precision.endswith("-true") else None)
        batch = tree_map(lambda t: fake_mode.from_tensor(t) if isinstance(t, Tensor) and not is_fake(t) else t,
                         make_batch(batch_size))
    if activation_checkpointing is not None:
        apply_activation_checkpointing(select_modules(model, activation_checkpointing))
    state = _Hooks(model, groups, records, live, {name: dtypes.get(name) for name in params} if sharded and mixed else None)
    batch_tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, Tensor)]
    live.track(params.values(), "param")
    live.track(buffers, "buffer")
    live.track(batch_tensors)
    with ExitStack() as stack:
        stack.enter_context(fake_mode)
        stack.enter_context(live)
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r"You are trying to `self.log\(\)`")
        model.train()
        # Lightning's own context for the precision: autocast without its weight cache for *-mixed, the
        # low default dtype for *-true.
        with torch.enable_grad(), precision_plugin_for(precision, "cpu").forward_context():
            loss = _run_training_step(model, batch)
        records.append(("backward",))
        state.backward = True
        try:
            loss.backward()
        except Exception as exc:  # an op without a fake implementation, a data-dependent branch
            raise ValueError(f"The backward of {class_name(model)}.training_step failed on fake tensors: {exc}") from exc
    state.remove()
    return StepTrace(
        records=records,
        batch_bytes=sum(t.untyped_storage().nbytes() for t in batch_tensors),
        buffer_bytes=sum(b.untyped_storage().nbytes() for b in buffers),
        units=tuple(state.forward_order),
        batch_size=batch_size,
        activation_checkpointing=None if activation_checkpointing is None else activation_checkpointing.describe(),
    )


def _note(records: list[Any], activations: int) -> None:
    if not records or records[-1] != activations:
        records.append(activations)


def _traced_dtypes(groups: Sequence[_Group], low: torch.dtype | None, precision: str, sharded: bool) -> dict[str, torch.dtype]:
    """The dtype each floating parameter has while the step computes with it."""
    dtypes = {}
    for group in groups:
        for param in group.params:
            if precision.endswith("-true") and low is not None:
                dtypes[param.name] = low  # the whole model is cast
            elif sharded and low is not None and param.compute < param.storage:
                dtypes[param.name] = low  # FSDP2 gathers it in the low dtype
    return dtypes


def _fake_state(model: nn.Module, dtypes: dict[str, torch.dtype], buffer_dtype: torch.dtype | None) -> tuple[dict, list]:
    """Replaces every parameter (a tied one once) and buffer by a fake CPU tensor; returns them."""
    fakes: dict[int, nn.Parameter] = {}
    by_name: dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters():
        dtype = dtypes.get(name, param.dtype) if param.is_floating_point() else param.dtype
        fake = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="cpu"), requires_grad=param.requires_grad)
        fakes[id(param)] = by_name[name] = fake
    buffers = []
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                module._parameters[key] = fakes[id(param)]
        for key, buffer in module._buffers.items():
            if buffer is not None:
                dtype = buffer_dtype if buffer_dtype is not None and buffer.is_floating_point() else buffer.dtype
                module._buffers[key] = torch.empty(buffer.shape, dtype=dtype, device="cpu")
                buffers.append(module._buffers[key])
    return by_name, buffers


def _run_training_step(model: nn.Module, batch: Any) -> Tensor:
    step = getattr(model, "training_step", None)
    if not callable(step):
        raise ValueError(f"{class_name(model)} has no training_step to trace; the estimator needs a LightningModule.")
    try:
        output = step(batch, 0)
    except Exception as exc:
        raise ValueError(
            f"{class_name(model)}.training_step failed on a fake batch ({exc.__class__.__name__}: {exc}). The estimator"
            " runs it without a Trainer, on tensors without values: pass a batch factory (--sample-batch"
            " MODULE:function) if the batch is not (tokens, targets)."
        ) from exc
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor) or not loss.requires_grad:
        raise ValueError(
            f"{class_name(model)}.training_step must return the loss (a tensor that requires grad, or a dict with"
            f" 'loss') for the estimator to trace its backward; it returned {type(output).__name__}."
        )
    return loss


class _Hooks:
    """The module and gradient hooks that mark the plan's units and the parameters' gradients in the record."""

    def __init__(
        self,
        model: nn.Module,
        groups: Sequence[_Group],
        records: list[Any],
        live: LiveTensors,
        cast: dict[str, torch.dtype | None] | None,
    ) -> None:
        self.records = records
        self.live = live
        self.backward = False
        self.forward_order: list[str] = []
        self.handles: list[Any] = []
        for group in groups:
            if group.is_root or not group.name:
                continue
            module = model.get_submodule(group.name)
            dtype = None
            if cast is not None:  # FSDP2 casts a unit's floating inputs to its parameters' dtype
                dtype = next((cast[p.name] for p in group.params if cast.get(p.name) is not None), torch.float32)
            self.handles.append(module.register_forward_pre_hook(self._pre_forward(group.name, dtype), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_forward(group.name)))
        # FSDP2 lets go of the last unit's all-gather buffer when the root's forward ends.
        self.handles.append(model.register_forward_hook(lambda *_: None if self.backward else records.append(("root_fw_end",))))
        params = dict(model.named_parameters())
        for name, param in params.items():
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(self._grad(name)))

    def _pre_forward(self, name: str, dtype: torch.dtype | None) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if dtype is not None:  # also when activation checkpointing recomputes the forward in backward
                args, kwargs = tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t,
                                        (args, kwargs))
            if self.backward:  # recomputation: FSDP2 leaves the unit gathered as its backward gathered it
                return args, kwargs
            self.records.append(("fw", name))
            if name not in self.forward_order:
                self.forward_order.append(name)
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.requires_grad]
            if inputs:
                torch.autograd.graph.register_multi_grad_hook(inputs, lambda _: self.records.append(("bw_end", name)))
            return args, kwargs

        return hook

    def _post_forward(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.backward:
                return
            self.records.append(("fw_end", name))
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda _: self.records.append(("bw", name)), mode="any"
                )

        return hook

    def _grad(self, name: str) -> Callable:
        def hook(param: Tensor) -> None:
            if param.grad is not None and self.live.category_of(param.grad) != "grad":
                self.records.append(("grad", name, self.live.categorize(param.grad, "grad")))

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# --- replaying a trace for one strategy ---------------------------------------------------------------------------


def step_peak(trace: StepTrace, groups: Sequence[_Group], estimate: Estimate, *, accumulate: int = 1) -> StepPeak:
    """The per-rank peak of ``estimate``'s strategy and world size over a step traced with :func:`trace_step`
    (``groups``: the plan the estimate counted). With ``accumulate`` micro-batches per optimizer step, every
    micro-batch is one traced step; the first frees the previous step's gradients, the last reduces them."""
    roles = ["only"] if accumulate == 1 else ["first", *(["middle"] if accumulate > 2 else []), "last"]
    replay = _replay_ddp if estimate.strategy == "ddp" else _replay_fsdp
    peaks = [replay(trace, groups, estimate, role) for role in roles]
    return max(peaks, key=lambda p: p.bytes)


class _Peak:
    def __init__(self) -> None:
        self.best = StepPeak(0, 0, "")

    def see(self, total: int, activations: int, moment: str) -> None:
        if total > self.best.bytes:
            self.best = StepPeak(total, activations, moment)


def _optimizer_temporaries(groups: Sequence[_Group], estimate: Estimate, shards: int) -> int:
    if estimate.optimizer not in ("adam", "adamw"):
        return 0
    largest = max((_shard_numel(p.shape, shards) * p.storage for g in groups for p in g.params if p.trainable), default=0)
    return _ADAM_TEMPORARIES * largest


def _replay_ddp(trace: StepTrace, groups: Sequence[_Group], estimate: Estimate, role: str) -> StepPeak:
    # Parameters, optimizer state, buffers and DDP's gradient buckets (gradients' size) stay for the whole fit;
    # the gradients exist from their first accumulation until zero_grad, just before the next backward.
    held = estimate.param_bytes + estimate.optimizer_bytes + estimate.grad_bytes
    held += trace.buffer_bytes + trace.batch_bytes * (_BATCHES_HELD - 1)
    grads = estimate.grad_bytes  # the previous step's, or this step's earlier micro-batches'
    peak, activations, phase = _Peak(), 0, "forward"
    for record in trace.records:
        if isinstance(record, int):
            activations = record
            peak.see(held + grads + activations, activations, phase)
        elif record[0] == "backward":
            phase = "backward"
            if role in ("only", "first"):
                grads = 0
        elif record[0] == "grad":
            if role in ("only", "first"):
                grads += record[2]
            else:  # accumulated in place: the new gradient lives only until it is added
                peak.see(held + grads + activations + record[2], activations, phase)
    if role in ("only", "last"):
        peak.see(held + estimate.grad_bytes + _optimizer_temporaries(groups, estimate, 1), 0, "optimizer step")
    return peak.best


def _replay_fsdp(trace: StepTrace, groups: Sequence[_Group], estimate: Estimate, role: str) -> StepPeak:
    shards = estimate.mesh[1]
    sizes = {g.name if not g.is_root else "": _sizes(g, shards) for g in groups}
    owner = {p.name: ("" if g.is_root else g.name) for g in groups for p in g.params}
    reshard_after_forward = estimate.strategy != "fsdp2_grad_op"
    offload = estimate.strategy == "fsdp2_offload"
    reduce = role in ("only", "last")
    held = estimate.param_bytes + estimate.optimizer_bytes + trace.buffer_bytes + trace.batch_bytes * (_BATCHES_HELD - 1)
    # Before zero_grad: the previous step's sharded gradients (first micro-batch), or the unsharded ones
    # accumulated by this step's earlier micro-batches (reduce dtype, full size).
    sharded_grads = 0 if offload or role in ("middle", "last") else estimate.grad_bytes
    accumulated = {u: (s.reduced if role in ("middle", "last") else 0) for u, s in sizes.items()}
    gathered: dict[str, int] = {}  # unsharded parameters
    buffers: dict[str, int] = {}  # all-gather outputs not yet copied out, or kept by FSDP2 (see gather)
    unsharded: dict[str, int] = dict.fromkeys(sizes, 0)
    reduce_input = 0
    done: set[str] = set()
    peak, activations, phase = _Peak(), 0, "forward"
    order = [u for u in trace.units if u in sizes]

    def total(extra: int = 0) -> int:
        return (held + sharded_grads + activations + sum(gathered.values()) + sum(buffers.values())
                + sum(unsharded.values()) + sum(accumulated.values()) + reduce_input + extra)

    def gather(unit: str) -> None:
        # The all-gather fills one flat buffer, copied out into the unit's parameters. In forward FSDP2 keeps
        # that buffer until the next unit's copy-out; in backward it lets it go at once, and gathers the
        # next unit ahead (prefetch), whose buffer waits until that unit's backward copies it out.
        if unit not in sizes or unit in gathered:
            return
        buffers.setdefault(unit, sizes[unit].gathered)
        gathered[unit] = sizes[unit].gathered
        peak.see(total(), activations, phase)
        if phase == "forward":
            for other in [u for u in buffers if u != unit]:
                del buffers[other]
        else:
            del buffers[unit]

    def prefetch(unit: str) -> None:
        if unit in sizes and unit not in gathered and unit not in buffers:
            buffers[unit] = sizes[unit].gathered
            peak.see(total(), activations, phase)

    def post_backward(unit: str) -> None:
        nonlocal reduce_input, sharded_grads
        if unit in done or unit not in sizes:
            return
        done.add(unit)
        gathered.pop(unit, None)
        size = sizes[unit]
        if not reduce:
            if unsharded[unit] and size.reduced != size.gathered_grads:  # upcast to the reduce dtype
                peak.see(total(size.reduced), activations, phase)
            accumulated[unit] = size.reduced if (unsharded[unit] or accumulated[unit]) else 0
            unsharded[unit] = 0
            return
        reduce_input = 0  # the previous unit's reduce-scatter input is let go first
        peak.see(total(size.reduced), activations, phase)  # copied in before the gradients are freed
        unsharded[unit] = accumulated[unit] = 0
        reduce_input = size.reduced
        sharded_grads += 0 if offload else size.sharded_trainable
        # gloo reduce-scatters a full copy of the input (measured on torch 2.13, CPU)
        peak.see(total(size.reduced), activations, phase)

    gather("")  # the root: gathered for the whole step
    for record in trace.records:
        if isinstance(record, int):
            activations = record
            peak.see(total(), activations, phase)
            continue
        kind = record[0]
        if kind == "fw":
            gather(record[1])
        elif kind == "fw_end" and reshard_after_forward:
            gathered.pop(record[1], None)
        elif kind == "root_fw_end":
            buffers.clear()
        elif kind == "backward":
            phase = "backward"
            buffers.clear()
            if role in ("only", "first"):
                sharded_grads = 0  # zero_grad
        elif kind == "bw":
            unit = record[1]
            gather(unit)
            if unit in order and order.index(unit) > 0:
                prefetch(order[order.index(unit) - 1])
        elif kind == "grad":
            unit = owner.get(record[1], "")
            if accumulated[unit] and sizes[unit].reduced == sizes[unit].gathered_grads:
                peak.see(total(record[2]), activations, phase)  # added in place to the accumulated gradient
            else:
                unsharded[unit] += record[2]
        elif kind == "bw_end":
            post_backward(record[1])
    for unit in reversed(order):  # units whose inputs needed no gradient reduce at the end of backward
        post_backward(unit)
    post_backward("")
    if reduce:
        reduce_input, activations, phase = 0, 0, "optimizer step"
        peak.see(total(_optimizer_temporaries(groups, estimate, shards)), 0, phase)
    return peak.best
