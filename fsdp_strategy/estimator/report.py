"""A model named by its class, estimated under every strategy at every world size, and the strategy to pick.

:func:`estimate` builds a LightningModule on the meta device, estimates every strategy at every world size
with :func:`~fsdp_strategy.estimator.model_state.estimate_module`, and recommends the simplest strategy that fits a memory
budget (``fsdp-strategy estimate``, and :func:`render_table`, the table it prints). Given a
batch size (and a sequence length or a batch factory), each row also gets the peak of a training step traced
on fake tensors (:mod:`~fsdp_strategy.estimator.peak`), and the budget picks the micro-batch size and activation
checkpointing as well (:mod:`~fsdp_strategy.estimator.fit`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from fsdp_strategy.checkpoint.pretrained import is_weights_directory
from fsdp_strategy.estimator.fit import Recommendation, fit_budget
from fsdp_strategy.estimator.groups import canonical_precision, unique_parameters
from fsdp_strategy.estimator.model_state import (
    STRATEGIES,
    Estimate,
    check_optimizer,
    estimate_module,
    node_size_mismatch,
)
from fsdp_strategy.estimator.peak import StepPeaks
from fsdp_strategy.estimator.target import load_function, load_target, weights_skeleton
from fsdp_strategy.estimator.trace import token_batch
from fsdp_strategy.option_checks import check_positive_int
from fsdp_strategy.sharding.policy import PolicyInput, class_name, normalize_policy
from fsdp_strategy.sizes import format_bytes, parse_bytes

__all__ = [
    "RECOMMENDATION_ORDER",
    "build_on_meta",
    "estimate",
    "EstimateReport",
    "recommend",
    "Recommendation",
    "render_table",
]

# Simplest first: the order in which strategies are tried against a budget.
RECOMMENDATION_ORDER = ("ddp", "fsdp2_grad_op", "fsdp2", "fsdp2_hybrid", "fsdp2_offload")


@dataclass(frozen=True)
class EstimateReport:
    """Every strategy at every world size, and a recommendation per world size when a budget is given."""

    model: str
    num_params: int
    precision: str
    optimizer: str
    budget: int | None
    rows: list[Estimate]
    skipped: list[tuple[str, int, str]] = field(default_factory=list)  # (strategy, world size, why)
    recommendations: list[Recommendation] = field(default_factory=list)
    batch_size: int | None = None  # samples per rank and forward of the traced step (None: not traced)
    activation_checkpointing: str | None = None  # the policy, described

    def recommendation(self, world_size: int) -> Recommendation | None:
        return next((r for r in self.recommendations if r.world_size == world_size), None)

    def table(self) -> str:
        return render_table(self)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "num_params": self.num_params,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "budget": self.budget,
            "rows": [row.as_dict() for row in self.rows],
            "skipped": [{"strategy": s, "world_size": w, "reason": r} for s, w, r in self.skipped],
            "recommendations": [asdict(r) for r in self.recommendations],
            "batch_size": self.batch_size,
            "activation_checkpointing": self.activation_checkpointing,
        }


def estimate(
    target: str | type[nn.Module],
    *,
    init_args: dict[str, Any] | None = None,
    world_sizes: Sequence[int],
    precision: str = "32-true",
    optimizer: str = "adamw",
    budget: int | str | None = None,
    processes_per_node: int | None = None,
    strategies: Sequence[str] = STRATEGIES,
    wrap_policy: PolicyInput = "auto",
    accumulate_grad_batches: int = 1,
    batch_size: int | None = None,
    seq_len: int | None = None,
    sample_batch: str | Callable[[int], Any] | None = None,
    activation_checkpointing: PolicyInput = None,
    frozen_dtype: str | None = None,
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: dict[str, str] | None = None,
) -> EstimateReport:
    """Estimates every strategy in ``strategies`` at every world size for a module built on the meta device.

    ``target`` is a module class or ``"package.module:Class"``; it is built with ``init_args`` on the
    meta device (``configure_model()`` too, when a LightningModule defines it), so no memory is
    allocated and no process group is needed. ``target`` may also be a Hugging Face weights directory
    (what ``save_pretrained`` writes): its parameters come from the safetensors headers, in the files' dtypes
    (:func:`~fsdp_strategy.estimator.target.weights_skeleton`); without the model's code no step is traced. With a ``budget`` (bytes per rank, an int or a
    string such as ``"80GiB"``) each world size gets the simplest strategy whose peak fits.

    With ``batch_size`` (samples per rank and forward) and either ``seq_len`` (the batch is ``(tokens,
    targets)``, two int64 tensors of ``batch_size x seq_len``) or ``sample_batch`` (a function, or
    ``"package.module:function"``, that returns a batch of ``n`` samples), the module's ``training_step`` and
    backward run once on fake tensors and every row gets the step's peak, activations included, also with
    ``activation_checkpointing`` (a policy in ``wrap_policy``'s forms) when given; the budget then also
    chooses activation checkpointing and the micro-batch size (:mod:`~fsdp_strategy.estimator.fit`).
    ``frozen_dtype`` counts frozen parameters in that dtype (see :func:`estimate_module`); the traced peak keeps
    them as built.

    ``tensor_parallel_size`` (the strategy's option) splits each world size into data-parallel x tensor-parallel
    ranks (``ddp`` is skipped): the split parameters are read from ``tensor_parallel_plan`` (Transformers' style
    strings by module name) or the model's Hugging Face ``base_model_tp_plan``, and a row's note says when neither
    exists. The activations tensor parallelism all-reduces are counted from the traced step, when there is one.

    Raises:
        ValueError / TypeError: a bad option, a target that cannot be imported or built.
    """
    budget_bytes = None if budget is None else parse_bytes(budget, option="budget")
    world_sizes = _check_world_sizes(world_sizes)
    strategies = _check_strategies(strategies)
    precision = canonical_precision(precision)
    check_optimizer(optimizer)
    normalize_policy(wrap_policy, option="wrap_policy")
    if processes_per_node is not None:
        check_positive_int("processes_per_node", processes_per_node)
    check_positive_int("accumulate_grad_batches", accumulate_grad_batches)
    check_positive_int("tensor_parallel_size", tensor_parallel_size)
    make_batch = _batch_factory(batch_size, seq_len, sample_batch, activation_checkpointing)
    checkpointing = normalize_policy(activation_checkpointing, option="activation_checkpointing")
    if is_weights_directory(target):
        if make_batch is not None or init_args:
            raise ValueError(
                f"The Hugging Face weights '{target}' hold parameters, not the model's code: `batch_size` (a traced"
                " step) and `init_args` need the module given as 'MODULE:Class'."
            )
        model = weights_skeleton(target)  # type: ignore[arg-type]
    else:
        cls = load_target(target)
        model = build_on_meta(cls, init_args or {})
    rows, skipped = [], []
    tensor = {"tensor_parallel_size": tensor_parallel_size, "tensor_parallel_plan": tensor_parallel_plan}
    for world_size in world_sizes:
        for strategy in strategies:
            reason = _skip_reason(strategy, world_size, processes_per_node, tensor_parallel_size)
            if reason:
                skipped.append((strategy, world_size, reason))
                continue
            rows.append(
                estimate_module(
                    model,
                    strategy=strategy,
                    world_size=world_size,
                    precision=precision,
                    optimizer=optimizer,
                    processes_per_node=processes_per_node,
                    wrap_policy=wrap_policy,
                    accumulate_grad_batches=accumulate_grad_batches,
                    frozen_dtype=frozen_dtype,
                    **tensor,
                )
            )
    peaks = None
    if make_batch is not None:
        peaks = StepPeaks(
            partial(build_on_meta, cls, init_args or {}),
            make_batch,
            precision=precision,
            wrap_policy=wrap_policy,
            activation_checkpointing=checkpointing,
            tensor_parallel_plan=tensor_parallel_plan,
        )
        rows = [_with_step_peak(row, peaks, batch_size, accumulate_grad_batches) for row in rows]
    if budget_bytes is None:
        recommendations = []
    elif peaks is None:
        recommendations = [recommend(rows, w, budget_bytes) for w in world_sizes]
    else:
        recommendations = []
        for world_size in world_sizes:
            names = [r.strategy for r in rows if r.world_size == world_size]

            def estimate_for(strategy: str, accumulate: int, world_size: int = world_size) -> Estimate:
                return estimate_module(
                    model,
                    strategy=strategy,
                    world_size=world_size,
                    precision=precision,
                    optimizer=optimizer,
                    processes_per_node=processes_per_node,
                    wrap_policy=wrap_policy,
                    accumulate_grad_batches=accumulate,
                    frozen_dtype=frozen_dtype,
                    **tensor,
                )

            recommendations.append(
                fit_budget(
                    estimate_for,
                    peaks,
                    world_size=world_size,
                    strategies=names,
                    batch_size=batch_size,
                    accumulate=accumulate_grad_batches,
                    budget=budget_bytes,
                )
            )
    return EstimateReport(
        model=str(target) if is_weights_directory(target) else class_name(model),
        num_params=sum(p.numel() for p in unique_parameters(model)),
        precision=precision,
        optimizer=optimizer,
        budget=budget_bytes,
        rows=rows,
        skipped=skipped,
        recommendations=recommendations,
        batch_size=batch_size if peaks is not None else None,
        activation_checkpointing=None if checkpointing is None else checkpointing.describe(),
    )


def _batch_factory(
    batch_size: int | None, seq_len: int | None, sample_batch: str | Callable[[int], Any] | None, checkpointing: Any
) -> Callable[[int], Any] | None:
    """What makes a batch of ``n`` samples for the traced step, or ``None`` when no batch was asked for."""
    if batch_size is None:
        given = [
            name
            for name, value in (
                ("seq_len", seq_len),
                ("sample_batch", sample_batch),
                ("activation_checkpointing", checkpointing),
            )
            if value is not None
        ]
        if given:
            raise ValueError(
                f"`{given[0]}` needs `batch_size` (samples per rank and forward): the step peak is traced on a batch;"
                " got batch_size=None."
            )
        return None
    check_positive_int("batch_size", batch_size)
    if (seq_len is None) == (sample_batch is None):
        raise ValueError(
            "`batch_size` needs one of `seq_len` (a (tokens, targets) batch of int64 tensors) or `sample_batch` (a"
            f" function of the number of samples, or 'package.module:function'); got seq_len={seq_len!r} and"
            f" sample_batch={sample_batch!r}."
        )
    if seq_len is not None:
        check_positive_int("seq_len", seq_len)
        return partial(token_batch, seq_len=seq_len)
    if callable(sample_batch):
        return sample_batch
    return load_function(sample_batch, option="sample_batch")


def _skip_reason(strategy: str, world_size: int, processes_per_node: int | None, tensor_parallel_size: int) -> str:
    if tensor_parallel_size > 1 and strategy == "ddp":
        return "ddp does not split layers (tensor_parallel_size needs an fsdp2 strategy)"
    if world_size % tensor_parallel_size:
        return f"tensor_parallel_size={tensor_parallel_size} does not divide the world size"
    if processes_per_node is not None and processes_per_node % tensor_parallel_size:
        # a tensor-parallel group stays within a node
        return f"tensor_parallel_size={tensor_parallel_size} does not divide processes_per_node={processes_per_node}"
    if strategy == "fsdp2_hybrid" and processes_per_node is not None and world_size % processes_per_node:
        return node_size_mismatch(processes_per_node, world_size)
    return ""


def _with_step_peak(row: Estimate, peaks: StepPeaks, batch_size: int, accumulate: int) -> Estimate:
    peak = peaks.peak(row, micro_batch_size=batch_size, accumulate=accumulate)
    if row.tensor_parallel > 1:
        traffic = peaks.tensor_parallel_all_reduce(row, micro_batch_size=batch_size, accumulate=accumulate)
        row = replace(row, tensor_parallel_all_reduce_bytes=traffic)
    checkpointed = None
    if peaks.activation_checkpointing is not None:
        checkpointed = peaks.peak(row, micro_batch_size=batch_size, checkpointed=True, accumulate=accumulate).bytes
    return replace(
        row,
        batch_size=batch_size,
        step_peak_bytes=peak.bytes,
        activation_bytes=peak.activation_bytes,
        checkpointed_peak_bytes=checkpointed,
    )


def recommend(rows: Sequence[Estimate], world_size: int, budget: int) -> Recommendation:
    """The first strategy in :data:`RECOMMENDATION_ORDER` whose peak bytes fit ``budget`` at ``world_size``,
    with the figures that rule out the simpler ones."""
    candidates = [r for r in rows if r.world_size == world_size]
    candidates.sort(key=lambda r: RECOMMENDATION_ORDER.index(r.strategy))
    if not candidates:
        return Recommendation(world_size, None, "no strategy was estimated at this world size")
    limit = format_bytes(budget)
    fits = [r for r in candidates if r.peak_bytes <= budget]
    too_big = candidates[: candidates.index(fits[0])] if fits else candidates
    needs = ", ".join(f"{r.strategy} {format_bytes(r.peak_bytes)}" for r in too_big)
    if not fits:
        return Recommendation(
            world_size,
            None,
            f"nothing fits the {limit} budget per rank ({needs}); use more ranks, a lower precision or a"
            " lighter optimizer",
        )
    chosen = fits[0]
    why = f"{chosen.strategy} needs {format_bytes(chosen.peak_bytes)} per rank <= {limit} budget"
    if len(too_big) == 1:
        simplest = too_big[0]
        why = f"{simplest.strategy} needs {format_bytes(simplest.peak_bytes)} per rank > {limit} budget; {why}"
        return Recommendation(world_size, chosen.strategy, why)
    if too_big:
        return Recommendation(world_size, chosen.strategy, f"{needs} per rank exceed the {limit} budget; {why}")
    return Recommendation(world_size, chosen.strategy, f"{why}, and it is the simplest")


def _check_world_sizes(world_sizes: Sequence[int]) -> list[int]:
    if isinstance(world_sizes, (str, bytes)) or not isinstance(world_sizes, Sequence) or not world_sizes:
        raise ValueError(f"`world_sizes` must be a non-empty list of positive ints; got {world_sizes!r}.")
    for size in world_sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"`world_sizes` must be a non-empty list of positive ints; got {world_sizes!r}.")
    return list(dict.fromkeys(world_sizes))


def _check_strategies(strategies: Sequence[str]) -> list[str]:
    unknown = [s for s in strategies if s not in STRATEGIES]
    if isinstance(strategies, str) or not strategies or unknown:
        raise ValueError(f"`strategies` must be a non-empty list from {', '.join(STRATEGIES)}; got {strategies!r}.")
    return sorted(set(strategies), key=RECOMMENDATION_ORDER.index)


def build_on_meta(cls: type[nn.Module], init_args: dict[str, Any]) -> nn.Module:
    """``cls(**init_args)`` with every tensor on the meta device, ``configure_model()`` included."""
    if not isinstance(init_args, dict):
        raise TypeError(f"`init_args` must be a dict of keyword arguments; got {type(init_args).__name__}.")
    call = f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in init_args.items())})"
    with torch.device("meta"):
        try:
            model = cls(**init_args)
        except (TypeError, ValueError) as exc:  # an unknown, missing or invalid argument
            raise ValueError(f"Could not build {call}: {exc}") from exc
        configure = getattr(model, "configure_model", None)
        if callable(configure):  # LightningModules may build their layers here
            configure()
    return model


# --- the text table -------------------------------------------------------------------------------------------

_STATE = ("strategy", "mesh", "params", "grads", "optimizer", "largest unit")
_COMMUNICATION = ("all-gather", "reduce-scatter", "all-reduce", "host")
_PEAK = "model state + gathered units and unsharded gradients (DDP: gradient buckets); activations not included"
_STEP_PEAK = (
    "the live tensors at the worst moment of a training step of {batch} samples per rank traced on fake tensors:"
    " model state, gathered units, unsharded gradients, activations and temporaries"
)


def _columns(traced: bool, checkpointed: bool, tensor_parallel: bool) -> list[str]:
    peaks = ["activations", "peak*"] + (["checkpointed*"] if checkpointed else []) if traced else ["peak*"]
    return [*_STATE, *peaks, *_COMMUNICATION, *(["tp all-reduce"] if tensor_parallel else [])]


def _cells(row: Estimate, traced: bool, checkpointed: bool, tensor_parallel: bool) -> list[str]:
    def size(value: int | None) -> str:
        return format_bytes(value) if value else "-"

    peaks = [size(row.activation_bytes), format_bytes(row.peak_bytes)] if traced else [format_bytes(row.peak_bytes)]
    peaks += [size(row.checkpointed_peak_bytes)] if checkpointed else []
    mesh = "x".join(str(n) for n in (*row.mesh, *([row.tensor_parallel] if tensor_parallel else [])))
    activations = row.tensor_parallel_all_reduce_bytes
    return [
        row.strategy,
        mesh,
        *(size(v) for v in (row.param_bytes, row.grad_bytes, row.optimizer_bytes, row.largest_unit_bytes)),
        *peaks,
        *(size(v) for v in (row.all_gather_bytes, row.reduce_scatter_bytes, row.all_reduce_bytes, row.host_bytes)),
        *([("n/e" if activations is None else size(activations))] if tensor_parallel else []),
    ]


def _aligned(table: list[list[str]]) -> list[str]:
    """Names left-aligned, sizes right-aligned, columns two spaces apart."""
    widths = [max(len(cell) for cell in column) for column in zip(*table)]
    return [
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
        for line in table
    ]


def render_table(report: EstimateReport) -> str:
    """The report as ``fsdp-strategy estimate`` prints it: a table per world size, then the recommendations."""
    lines = [
        f"{report.model}: {report.num_params:,} parameters, precision {report.precision}, optimizer {report.optimizer}",
        "Bytes per rank; communication in full-size bytes per optimizer step.",
    ]
    traced, checkpointed = report.batch_size is not None, report.activation_checkpointing is not None
    tensor_parallel = any(r.tensor_parallel > 1 for r in report.rows)
    # A world size where every strategy was skipped has no rows, only its reasons.
    world_sizes = sorted({r.world_size for r in report.rows} | {w for _, w, _ in report.skipped})
    for world_size in world_sizes:
        rows = [r for r in report.rows if r.world_size == world_size]
        lines += ["", f"world size {world_size}"]
        table = [
            _columns(traced, checkpointed, tensor_parallel),
            *(_cells(r, traced, checkpointed, tensor_parallel) for r in rows),
        ]
        lines += _aligned(table) if rows else []
        lines += [f"  {r.strategy}: {r.note}" for r in rows if r.note]
        lines += [f"  {s}: skipped: {why}" for s, w, why in report.skipped if w == world_size]
    lines += ["", f"* peak: {_STEP_PEAK.format(batch=report.batch_size) if traced else _PEAK}."]
    if tensor_parallel:
        lines.append(
            "  mesh: replicate x shard x tensor_parallel; tp all-reduce: the activations the tensor-parallel ranks"
            " all-reduce (n/e: not estimated, without a batch size or a known split)."
            + (
                " Activations are traced on the unsplit model, the peak's share of them an upper bound: each rank"
                " keeps only its part of a split layer's activations."
                if traced
                else ""
            )
        )
    if checkpointed:
        lines.append(f"  checkpointed: the same with activation checkpointing of {report.activation_checkpointing}.")
    if report.budget is None:
        lines.append("Pass a budget (--budget 80GiB) for a recommendation.")
    lines += [f"world size {r.world_size}: {r.strategy or 'none fits'} ({r.reason})" for r in report.recommendations]
    return "\n".join(lines)
