"""What ``fsdp-strategy benchmark`` writes: per-job figures, medians over repeats, ratios, CSV, JSON, table, plot.

Every function here takes plain rows (dicts, one per rank and run, as ``worker.py`` writes them plus the
``repeat`` the launcher adds) and needs neither torch nor a process group.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["CSV_FIELDS", "RATIOS", "format_table", "job_figures", "plot", "summarize", "write_csv", "write_json"]

CSV_FIELDS = (
    "strategy",
    "world_size",
    "repeat",
    "rank",
    "params",
    "precision",
    "batch_size",
    "seq_len",
    "rss_after_imports_bytes",
    "peak_rss_bytes",
    "growth_bytes",
    "train_growth_bytes",
    "stage_end_s",
    "model_state_bytes",
    "model_state_total_bytes",
    "model_state_over_ideal",
    "step_time_s",
    "cpu_time_s",
    "samples_per_s",
    "tokens_per_s",
    "loss_last",
)

# A job's figure is its worst rank's: the most memory, the slowest step (its ranks wait for each other anyway).
FIGURES = {
    "growth_bytes": max,
    "train_growth_bytes": max,
    "stage_end_s": max,
    "peak_rss_bytes": max,
    "model_state_bytes": max,
    "model_state_over_ideal": max,
    "step_time_s": max,
    "cpu_time_s": max,
    "samples_per_s": min,
    "tokens_per_s": min,
}

# (summary key, figure, reference strategy). Each is the median over repeats of a job's figure divided by the
# reference job's of the same repeat and world size: the two ran close together, under about the same load.
RATIOS = (
    ("growth_over_ddp", "growth_bytes", "ddp"),
    ("train_growth_over_ddp", "train_growth_bytes", "ddp"),
    ("step_time_over_raw_fsdp2", "step_time_s", "raw_fsdp2"),
    ("step_time_over_model_parallel", "step_time_s", "model_parallel"),
    ("cpu_time_over_raw_fsdp2", "cpu_time_s", "raw_fsdp2"),
    ("cpu_time_over_model_parallel", "cpu_time_s", "model_parallel"),
)

LABELS = {
    "ddp": "DDP",
    "fsdp2": 'FSDP2Strategy ("fsdp2")',
    "fsdp2_grad_op": 'FSDP2Strategy ("fsdp2_grad_op")',
    "model_parallel": "ModelParallelStrategy + configure_model",
    "raw_fsdp2": "raw FSDP2 loop, no Lightning",
}
COLORS = {
    "ddp": "#8c8c8c",
    "fsdp2": "#1f77b4",
    "fsdp2_grad_op": "#7fb8e0",
    "model_parallel": "#ff7f0e",
    "raw_fsdp2": "#2ca02c",
}

# With ``--baseline NAME`` (an A/B candidate against what it would replace): these, over NAME's same-round job.
BASELINE_RATIOS = (
    ("growth_over_baseline", "growth_bytes"),
    ("train_growth_over_baseline", "train_growth_bytes"),
    ("step_time_over_baseline", "step_time_s"),
    ("cpu_time_over_baseline", "cpu_time_s"),
)

Job = tuple[str, int, int]  # (strategy, world size, repeat)


def job_figures(rows: list[dict[str, Any]]) -> dict[Job, dict[str, float]]:
    """Each job's figures (see :data:`FIGURES`), from its ranks' rows."""
    ranks: dict[Job, list[dict[str, Any]]] = {}
    for row in rows:
        ranks.setdefault((row["strategy"], row["world_size"], row["repeat"]), []).append(row)
    return {
        job: {name: pick(r[name] for r in job_rows) for name, pick in FIGURES.items()}
        for job, job_rows in ranks.items()
    }


def summarize(rows: list[dict[str, Any]], baseline: str | None = None) -> list[dict[str, Any]]:
    """One entry per (strategy, world size), in the order first run: medians, ranges and ratios over repeats
    (with ``baseline``, also over that strategy's job of the same round)."""
    jobs = job_figures(rows)
    summary = []
    for strategy, world_size in dict.fromkeys((s, w) for s, w, _ in jobs):
        repeats = sorted(r for s, w, r in jobs if (s, w) == (strategy, world_size))
        entry: dict[str, Any] = {"strategy": strategy, "world_size": world_size, "repeats": len(repeats)}
        for name in FIGURES:
            values = [jobs[strategy, world_size, r][name] for r in repeats]
            entry[name] = statistics.median(values)
            entry[f"{name}_min"], entry[f"{name}_max"] = min(values), max(values)
        pairs = [(key, name, reference) for key, name, reference in RATIOS]
        if baseline is not None:
            entry["baseline"] = baseline
            pairs += [(key, name, baseline) for key, name in BASELINE_RATIOS]
        for key, name, reference in pairs:
            ratios = [
                jobs[strategy, world_size, r][name] / jobs[reference, world_size, r][name]
                for r in repeats
                if (reference, world_size, r) in jobs
            ]
            entry[key] = statistics.median(ratios) if ratios else None
            if baseline is not None and reference == baseline:
                entry[f"{key}_min"], entry[f"{key}_max"] = (min(ratios), max(ratios)) if ratios else (None, None)
        summary.append(entry)
    return summary


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_json(rows: list[dict[str, Any]], summary: list[dict[str, Any]], config: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps({"config": config, "summary": summary, "rows": rows}, indent=1) + "\n")


def format_table(summary: list[dict[str, Any]]) -> str:
    """A Markdown table of the summary (memory in MiB, times in ms)."""
    header = (
        "| strategy | ranks | memory growth / rank (MiB) | vs ddp | model state / rank (MiB) | over ideal"
        " | step (ms) | vs raw_fsdp2 | vs model_parallel | CPU / step (ms) | CPU vs raw_fsdp2 | CPU vs model_parallel"
        " | tokens/s | growth until training ended (MiB) | vs ddp |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    baseline = summary[0].get("baseline") if summary else None
    if baseline is not None:
        header += (
            f" memory vs {baseline} [min, max] | until training ended vs {baseline} [min, max]"
            f" | CPU vs {baseline} [min, max] |"
        )
        rule += "---:|---:|---:|"
    lines = [header, rule]
    for e in summary:
        cells = [
            e["strategy"],
            str(e["world_size"]),
            f"{e['growth_bytes'] / 2**20:,.0f}",
            _ratio(e["growth_over_ddp"]),
            f"{e['model_state_bytes'] / 2**20:,.1f}",
            f"{e['model_state_over_ideal']:.3f}",
            f"{e['step_time_s'] * 1e3:,.1f}",
            _ratio(e["step_time_over_raw_fsdp2"]),
            _ratio(e["step_time_over_model_parallel"]),
            f"{e['cpu_time_s'] * 1e3:,.1f}",
            _ratio(e["cpu_time_over_raw_fsdp2"]),
            _ratio(e["cpu_time_over_model_parallel"]),
            f"{e['tokens_per_s']:,.0f}",
            _mib_range(e, "train_growth_bytes"),
            _ratio(e["train_growth_over_ddp"]),
        ]
        if baseline is not None:
            cells += [
                _ratio_range(e, "growth_over_baseline"),
                _ratio_range(e, "train_growth_over_baseline"),
                _ratio_range(e, "cpu_time_over_baseline"),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _mib_range(entry: dict[str, Any], key: str) -> str:
    return f"{entry[key] / 2**20:,.0f} [{entry[f'{key}_min'] / 2**20:,.0f}, {entry[f'{key}_max'] / 2**20:,.0f}]"


def _ratio_range(entry: dict[str, Any], key: str) -> str:
    if entry[key] is None:
        return "-"
    return f"{entry[key]:.3f} [{entry[f'{key}_min']:.3f}, {entry[f'{key}_max']:.3f}]"


def plot(summary: list[dict[str, Any]], path: Path, *, title: str) -> None:
    """Two panels: memory growth per rank (model state shaded dark) and throughput, by world size and strategy."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    strategies = list(dict.fromkeys(e["strategy"] for e in summary))
    worlds = sorted({e["world_size"] for e in summary})
    width = 0.8 / len(strategies)
    rate_scale, rate_unit = (
        (1e-3, "thousand tokens / s") if max(e["tokens_per_s"] for e in summary) >= 1e3 else (1, "tokens / s")
    )
    fig = Figure(figsize=(13, 5.6), layout="constrained")
    memory, speed = fig.subplots(1, 2)
    for i, strategy in enumerate(strategies):
        entries = [
            next((e for e in summary if e["strategy"] == strategy and e["world_size"] == w), None) for w in worlds
        ]
        xs = [j + (i - (len(strategies) - 1) / 2) * width for j, e in enumerate(entries) if e is not None]
        present = [e for e in entries if e is not None]
        color = COLORS.get(strategy, f"C{i}")
        growth = _bars(memory, xs, present, "growth_bytes", 2**-30, width, color, alpha=0.45)
        _bars(memory, xs, present, "model_state_bytes", 2**-30, width, color, alpha=1.0, whiskers=False)
        memory.bar_label(
            growth, labels=[_ratio_label(e["growth_over_ddp"], "ddp") for e in present], fontsize=8, padding=2
        )
        rate = _bars(
            speed,
            xs,
            present,
            "tokens_per_s",
            rate_scale,
            width,
            color,
            alpha=1.0,
            label=LABELS.get(strategy, strategy),
        )
        speed.bar_label(rate, labels=[f"{e['tokens_per_s'] * rate_scale:.3g}" for e in present], fontsize=8, padding=2)
    for axis in (memory, speed):
        axis.set_xticks(range(len(worlds)), [f"{w} rank{'s' if w > 1 else ''}" for w in worlds])
        axis.set_xlabel("world size (CPU processes)")
        axis.grid(axis="y", alpha=0.3)
        axis.set_axisbelow(True)
        axis.margins(y=0.12)
    memory.set_title(
        "Host memory growth per rank (peak RSS − RSS after imports)\ndark: parameters + gradients +"
        " optimizer state; label: ratio to DDP",
        fontsize=10,
    )
    memory.set_ylabel("GiB per rank (worst rank)")
    speed.set_title("Training throughput, all ranks together\n(median step after warm-up)", fontsize=10)
    speed.set_ylabel(rate_unit)
    fig.legend(
        *speed.get_legend_handles_labels(), loc="outside lower center", ncols=len(strategies), fontsize=9, frameon=False
    )
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=120)


def _bars(axis, xs, entries, name, scale, width, color, *, alpha, whiskers=True, label=None):  # type: ignore[no-untyped-def]
    values = [e[name] * scale for e in entries]
    errors = None
    if whiskers:  # the range over repeats
        errors = [
            [v - e[f"{name}_min"] * scale for v, e in zip(values, entries)],
            [e[f"{name}_max"] * scale - v for v, e in zip(values, entries)],
        ]
    return axis.bar(
        xs,
        values,
        width,
        yerr=errors,
        color=color,
        alpha=alpha,
        label=label,
        capsize=3,
        error_kw={"elinewidth": 1, "alpha": 0.7},
    )


def _ratio_label(value: float | None, reference: str) -> str:
    return "" if value is None else f"{value:.2f}×"
