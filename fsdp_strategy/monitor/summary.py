"""From one row of numbers per rank to the run's summary: gathering the rows from all ranks, adding
them up into throughput, TFLOP/s and MFU, and the table printed when fit ends."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from fsdp_strategy.monitor.flops import model_flops_utilization
from fsdp_strategy.sizes import format_bytes

__all__ = ["FIELDS", "format_summary", "gather_rows", "max_over_ranks", "summarize"]

# One row per rank, gathered as a float64 tensor; NaN marks a value this rank could not measure.
FIELDS = (
    "peak_rss_bytes",
    "rss_growth_bytes",
    "live_peak_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "model_state_bytes",
    "samples",
    "tokens",
    "batches",
    "seconds",
    "flops_per_batch",
)


def gather_rows(row: dict[str, float], device: torch.device) -> list[dict[str, float]]:
    """Every rank's row, in rank order (a collective where a process group exists: all ranks call it)."""
    mine = torch.tensor([row[field] for field in FIELDS], dtype=torch.float64, device=device)
    rows = [mine]
    if dist.is_available() and dist.is_initialized():
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
    return [dict(zip(FIELDS, values)) for values in torch.stack(rows).cpu().tolist()]


def _value(x: float) -> float | None:
    return None if math.isnan(x) else x


def summarize(rows: list[dict[str, float]], *, peak_flops: float | None) -> dict[str, Any]:
    """Per-rank memory and throughput rows plus the run's totals.

    Samples and tokens per second are those of all ranks together over the slowest rank's time;
    TFLOP/s is per device (the mean over ranks), and MFU divides it by the device's peak."""
    ranks = []
    for rank, row in enumerate(rows):
        seconds = row["seconds"]
        timed = seconds > 0  # False for NaN as well
        ranks.append(
            {
                "rank": rank,
                **{field: _value(row[field]) for field in FIELDS[:6]},
                "samples_per_sec": row["samples"] / seconds if timed else None,
                "tokens_per_sec": _value(row["tokens"] / seconds) if timed else None,
                "tflops_per_sec": _value(row["flops_per_batch"] * row["batches"] / seconds / 1e12) if timed else None,
            }
        )
    seconds = max((row["seconds"] for row in rows), default=math.nan)
    timed = seconds > 0
    per_device = [r["tflops_per_sec"] for r in ranks if r["tflops_per_sec"] is not None]
    tflops = sum(per_device) / len(per_device) if per_device and len(per_device) == len(ranks) else None
    return {
        "world_size": len(rows),
        "ranks": ranks,
        "measured_seconds": seconds if timed else None,
        "measured_batches": int(rows[0]["batches"]) if rows and timed else 0,
        "samples_per_sec": sum(row["samples"] for row in rows) / seconds if timed else None,
        "tokens_per_sec": _value(sum(row["tokens"] for row in rows) / seconds) if timed else None,
        "tflops_per_sec": tflops,
        "mfu": model_flops_utilization(tflops, peak_flops),
        "flops_per_batch": _value(rows[0]["flops_per_batch"]) if rows else None,
        "peak_tflops": peak_flops / 1e12 if peak_flops else None,
        "max_peak_rss_bytes": max_over_ranks(ranks, "peak_rss_bytes"),
        "max_live_peak_bytes": max_over_ranks(ranks, "live_peak_bytes"),
        "max_peak_allocated_bytes": max_over_ranks(ranks, "peak_allocated_bytes"),
        "max_model_state_bytes": max_over_ranks(ranks, "model_state_bytes"),
    }


def max_over_ranks(ranks: list[dict[str, Any]], field: str) -> float | None:
    """The largest of the ranks' ``field``; ``None`` where no rank measured it."""
    values = [r[field] for r in ranks if r[field] is not None]
    return max(values) if values else None


def _bytes(value: float | None) -> str:
    return "n/a" if value is None else format_bytes(value)


def _number(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _significant(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in [header, *rows]]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return lines


def _mesh(mesh: list[int] | None) -> str:
    if not mesh:
        return ""
    replicate, shard, tensor = mesh
    return f", mesh {replicate} replicate x {shard} shard" + (f" x {tensor} tensor_parallel" if tensor > 1 else "")


def _tensor_parallel(summary: dict[str, Any]) -> str:
    if not summary.get("mesh") or summary["mesh"][2] == 1:
        return ""
    if summary.get("tensor_parallel_all_reduce_bytes") is None:
        # The monitor traces no batch: activation sizes, and the ring sends they add, are left out.
        return ", tensor-parallel activation all-reduce not estimated"
    return f", tensor-parallel activation all-reduce {_bytes(summary['tensor_parallel_all_reduce_bytes'])}"


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a table that reads well in a terminal."""
    cuda = any(r["peak_allocated_bytes"] is not None for r in summary["ranks"])
    header = ["rank", "peak RSS", "RSS growth", "live peak"] + (
        ["CUDA peak alloc", "CUDA peak reserved"] if cuda else []
    )
    header += ["model state", "samples/s", "tokens/s", "TFLOP/s"]
    rows = []
    for r in summary["ranks"]:
        row = [str(r["rank"]), _bytes(r["peak_rss_bytes"]), _bytes(r["rss_growth_bytes"]), _bytes(r["live_peak_bytes"])]
        if cuda:
            row += [_bytes(r["peak_allocated_bytes"]), _bytes(r["peak_reserved_bytes"])]
        row += [
            _bytes(r["model_state_bytes"]),
            _number(r["samples_per_sec"]),
            _number(r["tokens_per_sec"], 0),
            _significant(r["tflops_per_sec"]),
        ]
        rows.append(row)
    title = (
        f"ShardingMonitor: {summary.get('strategy', '?')} | {summary['world_size']} x {summary.get('device', '?')}"
        f" | {summary.get('precision', '?')} | {summary.get('steps', '?')} steps, throughput over"
        f" {summary['measured_batches']} batches (after {summary.get('warmup_steps', '?')} warm-up steps)"
    )
    if summary["mfu"] is not None:
        mfu = f"{summary['mfu']:.1%} of {summary['peak_tflops']:,.1f} TFLOP/s peak"
    elif summary["tflops_per_sec"] is not None:
        mfu = "n/a (device peak unknown: pass peak_tflops=)"
    else:
        mfu = "n/a"
    lines = [
        title,
        *_grid(header, rows),
        f"all ranks: {_number(summary['samples_per_sec'])} samples/s, {_number(summary['tokens_per_sec'], 0)} tokens/s;"
        f" per device {_significant(summary['tflops_per_sec'])} TFLOP/s, MFU {mfu}",
    ]
    if summary.get("all_gather_bytes") is not None:
        lines.append(
            f"communication per step and rank ({summary['strategy']} plan{_mesh(summary.get('mesh'))}): all-gather"
            f" {_bytes(summary['all_gather_bytes'])}, reduce-scatter {_bytes(summary['reduce_scatter_bytes'])},"
            f" all-reduce {_bytes(summary['all_reduce_bytes'])}{_tensor_parallel(summary)};"
            f" ring sends {_bytes(summary['sent_bytes'])}"
        )
        lines.append(
            f"model state per rank: measured {_bytes(summary['max_model_state_bytes'])} (largest rank),"
            f" estimated {_bytes(summary['estimated_model_state_bytes'])}"
        )
        if summary.get("estimate_note"):
            lines.append(f"estimate: {summary['estimate_note']}")
    else:
        lines.append(f"communication per step: n/a ({summary.get('communication_note', 'no sharding plan')})")
    return "\n".join(lines)
