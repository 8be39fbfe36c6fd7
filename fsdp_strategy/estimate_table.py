"""An :class:`~fsdp_strategy.estimate_report.EstimateReport` as the text table ``fsdp-strategy estimate`` prints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_strategy.sizes import format_bytes

if TYPE_CHECKING:
    from fsdp_strategy.estimate import Estimate
    from fsdp_strategy.estimate_report import EstimateReport

__all__ = ["render_table"]

_STATE = ("strategy", "mesh", "params", "grads", "optimizer", "largest unit")
_COMMUNICATION = ("all-gather", "reduce-scatter", "all-reduce", "host")
_PEAK = "model state + gathered units and unsharded gradients (DDP: gradient buckets); activations not included"
_STEP_PEAK = (
    "the live tensors at the worst moment of a training step of {batch} samples per rank traced on fake tensors:"
    " model state, gathered units, unsharded gradients, activations and temporaries"
)


def _columns(traced: bool, checkpointed: bool) -> list[str]:
    peaks = ["activations", "peak*"] + (["checkpointed*"] if checkpointed else []) if traced else ["peak*"]
    return [*_STATE, *peaks, *_COMMUNICATION]


def _cells(row: Estimate, traced: bool, checkpointed: bool) -> list[str]:
    def size(value: int | None) -> str:
        return format_bytes(value) if value else "-"

    peaks = [size(row.activation_bytes), format_bytes(row.peak_bytes)] if traced else [format_bytes(row.peak_bytes)]
    peaks += [size(row.checkpointed_peak_bytes)] if checkpointed else []
    return [
        row.strategy,
        f"{row.mesh[0]}x{row.mesh[1]}",
        *(size(v) for v in (row.param_bytes, row.grad_bytes, row.optimizer_bytes, row.largest_unit_bytes)),
        *peaks,
        *(size(v) for v in (row.all_gather_bytes, row.reduce_scatter_bytes, row.all_reduce_bytes, row.host_bytes)),
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
    # A world size where every strategy was skipped has no rows, only its reasons.
    world_sizes = sorted({r.world_size for r in report.rows} | {w for _, w, _ in report.skipped})
    for world_size in world_sizes:
        rows = [r for r in report.rows if r.world_size == world_size]
        lines += ["", f"world size {world_size}"]
        table = [_columns(traced, checkpointed), *(_cells(r, traced, checkpointed) for r in rows)]
        lines += _aligned(table) if rows else []
        lines += [f"  {r.strategy}: {r.note}" for r in rows if r.note]
        lines += [f"  {s}: skipped: {why}" for s, w, why in report.skipped if w == world_size]
    lines += ["", f"* peak: {_STEP_PEAK.format(batch=report.batch_size) if traced else _PEAK}."]
    if checkpointed:
        lines.append(f"  checkpointed: the same with activation checkpointing of {report.activation_checkpointing}.")
    if report.budget is None:
        lines.append("Pass a budget (--budget 80GiB) for a recommendation.")
    lines += [f"world size {r.world_size}: {r.strategy or 'none fits'} ({r.reason})" for r in report.recommendations]
    return "\n".join(lines)
