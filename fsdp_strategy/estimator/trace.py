"""One training step run on fake tensors, recorded for :mod:`fsdp_strategy.estimator.peak` to replay per plan.

:func:`trace_step` runs the LightningModule's own ``training_step`` and the backward of its loss once, on fake
tensors (shapes and dtypes, no memory, no process group), the way Lightning runs them: under autocast for
``*-mixed``, with the strategy's activation checkpointing when a policy is given, the previous step's gradients
alive until ``zero_grad`` just before backward. A :class:`~fsdp_strategy.estimator.live_tensors.LiveTensors` mode counts
op by op the bytes of every tensor that is neither a parameter, a buffer nor a parameter's gradient (saved
activations, temporaries, gradients of activations, the batch), and hooks record when each unit of the
sharding plan (:func:`fsdp_strategy.estimator.groups.plan_groups`) starts and ends its forward and its backward and when
each parameter's gradient appears.

Parameters under ``*-mixed`` are traced in the dtype the strategy computes with: FSDP2 gathers them in bf16
(norm units in fp32) and casts a unit's inputs to it, while DDP keeps fp32 weights and autocast makes the
low-precision copies, which the trace counts as activations. Autocast follows CPU rules (the trace runs on
fake CPU tensors), so a CUDA run may keep a few ops in another dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fsdp_strategy._compat import FakeTensorMode, is_fake, tree_flatten, tree_map
from fsdp_strategy.estimator.groups import UnitGroup
from fsdp_strategy.estimator.live_tensors import OTHER, LiveTensors
from fsdp_strategy.plugins.precision import precision_plugin_for
from fsdp_strategy.sharding.parallelize import apply_activation_checkpointing
from fsdp_strategy.sharding.policy import ModulePolicy, class_name, select_modules

__all__ = ["StepTrace", "token_batch", "trace_step"]

_LOW_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}


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
    # For each layer named in trace_step's `layers`: the bytes of its input and of its output over the step's
    # forward (recomputation left out), the activations tensor parallelism communicates around it.
    layer_activations: dict[str, tuple[int, int]] = field(default_factory=dict)


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
    groups: Sequence[UnitGroup],
    sharded: bool,
    activation_checkpointing: ModulePolicy | None = None,
    layers: Sequence[str] = (),
) -> StepTrace:
    """Runs ``model.training_step`` and backward once on fake tensors and records what it holds (see the module).
    ``layers``: qualified module names whose input and output bytes the trace adds up (tensor parallelism's
    collectives, :attr:`StepTrace.layer_activations`).

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
        batch = tree_map(
            lambda t: fake_mode.from_tensor(t) if isinstance(t, Tensor) and not is_fake(t) else t,
            make_batch(batch_size),
        )
    if activation_checkpointing is not None:
        apply_activation_checkpointing(select_modules(model, activation_checkpointing))
    state = _Hooks(
        model, groups, records, live, {name: dtypes.get(name) for name in params} if sharded and mixed else None
    )
    state.watch_layers(model, layers)
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
            raise ValueError(
                f"The backward of {class_name(model)}.training_step failed on fake tensors: {exc}"
            ) from exc
    state.remove()
    return StepTrace(
        records=records,
        batch_bytes=sum(t.untyped_storage().nbytes() for t in batch_tensors),
        buffer_bytes=sum(b.untyped_storage().nbytes() for b in buffers),
        units=tuple(state.forward_order),
        batch_size=batch_size,
        activation_checkpointing=None if activation_checkpointing is None else activation_checkpointing.describe(),
        layer_activations=state.layer_activations,
    )


def _note(records: list[Any], activations: int) -> None:
    if not records or records[-1] != activations:
        records.append(activations)


def _traced_dtypes(
    groups: Sequence[UnitGroup], low: torch.dtype | None, precision: str, sharded: bool
) -> dict[str, torch.dtype]:
    """The dtype each floating parameter has while the step computes with it."""
    dtypes = {}
    for group in groups:
        for param in group.params:
            if precision.endswith("-true") and low is not None:
                dtypes[param.name] = low  # the whole model is cast
            elif sharded and low is not None and param.compute < param.storage:
                dtypes[param.name] = low  # FSDP2 gathers it in the low dtype
    return dtypes


def _fake_state(
    model: nn.Module, dtypes: dict[str, torch.dtype], buffer_dtype: torch.dtype | None
) -> tuple[dict, list]:
    """Replaces every parameter (a tied one once) and buffer by a fake CPU tensor; returns them."""
    fakes: dict[int, nn.Parameter] = {}
    by_name: dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters():
        dtype = dtypes.get(name, param.dtype) if param.is_floating_point() else param.dtype
        fake = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="cpu"), requires_grad=param.requires_grad)
        fakes[id(param)] = by_name[name] = fake
    buffers: dict[int, Tensor] = {}
    replaced: list[Tensor] = []  # alive until the end, so that no other tensor takes a replaced one's id
    for module in model.modules():
        # Module.__setattr__ keeps a registered parameter or buffer registered (and a buffer's persistence).
        for key, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            setattr(module, key, fakes[id(param)])
        for key, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if id(buffer) not in buffers:
                dtype = buffer_dtype if buffer_dtype is not None and buffer.is_floating_point() else buffer.dtype
                buffers[id(buffer)] = torch.empty(buffer.shape, dtype=dtype, device="cpu")
            replaced.append(buffer)
            setattr(module, key, buffers[id(buffer)])
    return by_name, list(buffers.values())


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
        groups: Sequence[UnitGroup],
        records: list[Any],
        live: LiveTensors,
        cast: dict[str, torch.dtype | None] | None,
    ) -> None:
        self.records = records
        self.live = live
        self.backward = False
        self.forward_order: list[str] = []
        self.handles: list[Any] = []
        self.layer_activations: dict[str, tuple[int, int]] = {}
        for group in groups:
            if group.is_root or not group.name:
                continue
            dtype = None
            if cast is not None:  # FSDP2 casts a unit's floating inputs to its parameters' dtype
                dtype = next((cast[p.name] for p in group.params if cast.get(p.name) is not None), torch.float32)
            # A group of several modules (fully_shard([a, b])) is one unit: every member's events are the unit's.
            for member in group.name.split(","):
                module = model.get_submodule(member)
                self.handles.append(
                    module.register_forward_pre_hook(self._pre_forward(group.name, dtype), with_kwargs=True)
                )
                self.handles.append(module.register_forward_hook(self._post_forward(group.name)))
        # FSDP2 lets go of the last unit's all-gather buffer when the root's forward ends.
        self.handles.append(
            model.register_forward_hook(lambda *_: None if self.backward else records.append(("root_fw_end",)))
        )
        params = dict(model.named_parameters())
        for name, param in params.items():
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(self._grad(name)))

    def _pre_forward(self, name: str, dtype: torch.dtype | None) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if dtype is not None:  # also when activation checkpointing recomputes the forward in backward
                args, kwargs = tree_map(
                    lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t, (args, kwargs)
                )
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

    def watch_layers(self, model: nn.Module, layers: Sequence[str]) -> None:
        for name in layers:
            self.layer_activations[name] = (0, 0)
            self.handles.append(model.get_submodule(name).register_forward_hook(self._layer_bytes(name)))

    def _layer_bytes(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.backward:  # activation checkpointing's recomputation
                return
            inputs, outputs = self.layer_activations[name]
            self.layer_activations[name] = (inputs + _tensor_bytes(args), outputs + _tensor_bytes(output))

        return hook

    def _grad(self, name: str) -> Callable:
        def hook(param: Tensor) -> None:
            if param.grad is not None and self.live.category_of(param.grad) != "grad":
                self.records.append(("grad", name, self.live.categorize(param.grad, "grad")))

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, Tensor))
