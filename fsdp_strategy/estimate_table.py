"""An :class:`~fsdp_strategy.estimate_report.EstimateReport` as the text table ``fsdp-strategy estimate`` prints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_strategy.sizes import format_bytes

if TYPE_CHECKING:
    from fsdp_strategy.estimate import Estimate
    from fsdp_strategy.estimate_report import EstimateReport

__all__ = ["render_table"]

_COLUMNS = ("strategy", "mesh", "params", "grads", "optimizer", "largest unit", "peak*")
_COLUMNS += ("all-gather", "reduce-scatter", "all-reduce", "host")
_PEAK = "model state + gathered units and unsharded gradients (DDP: gradient buckets)"


def _cells(row: Estimate) -> list[str]:
    def size(value: int) -> str:
        return format_bytes(value) if value else "-"

    return [
        row.strategy,
        f"{row.mesh[0]}x{row.mesh[1]}",
        *(size(v) for v in (row.param_bytes, row.grad_bytes, row.optimizer_bytes, row.largest_unit_bytes)),
        format_bytes(row.peak_bytes),
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
    # A world size where every strategy was skipped has no rows, only its reasons.
    world_sizes = sorted({r.world_size for r in report.rows} | {w for _, w, _ in report.skipped})
    for world_size in world_sizes:
        rows = [r for r in report.rows if r.world_size == world_size]
        lines += ["", f"world size {world_size}"]
        lines += _aligned([list(_COLUMNS), *map(_cells, rows)]) if rows else []
        lines += [f"  {r.strategy}: {r.note}" for r in rows if r.note]
        lines += [f"  {s}: skipped: {why}" for s, w, why in report.skipped if w == world_size]
    lines += ["", f"* peak: {_PEAK}; activations not included."]
    if report.budget is None:
        lines.append("Pass a budget (--budget 80GiB) for a recommendation.")
    lines += [f"world size {r.world_size}: {r.strategy or 'none fits'} ({r.reason})" for r in report.recommendations]
    return "\n".join(lines)
