"""``fsdp-strategy benchmark``: the same model under several strategies and world sizes, side by side.

Each (strategy, world size, repeat) is a fresh ``torchrun --standalone`` job on CPU (gloo,
``OMP_NUM_THREADS=1``), so every run starts from a clean process and its resident memory is its own. Repeats
are interleaved (all configurations once, then all again, each round in a rotated order), so that a change in
the machine's load falls on every configuration alike. See ``worker.py`` for what each rank measures and
``report.py`` for the medians and ratios.
"""

from __future__ import annotations

import collections
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fsdp_strategy.tools.benchmark.gpt import GPT_SIZES
from fsdp_strategy.tools.benchmark.options import (
    PRECISIONS,
    PROGRESS_PREFIX,
    STRATEGIES,
    load_model_class,
    parse_variant,
)
from fsdp_strategy.tools.benchmark.report import (
    format_table,
    plot,
    summarize,
    write_csv,
    write_json,
)

__all__ = ["EXTRAS", "Job", "interleaved_jobs", "parse_strategies", "require_extras", "run_benchmark", "validate"]

EXTRAS = ("matplotlib", "tqdm", "psutil")
GPT_SPEC = "fsdp_strategy.tools.benchmark.gpt:GPT"


@dataclass(frozen=True)
class Job:
    strategy: str
    world_size: int
    repeat: int


def require_extras(modules: tuple[str, ...] = EXTRAS) -> None:
    """Raises ``ImportError`` naming the missing modules and the extra that installs them."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"fsdp-strategy benchmark needs {', '.join(modules)}; not installed: {', '.join(missing)}."
            " Install them with: pip install 'fsdp-strategy[benchmarks]'"
        )


def parse_strategies(text: str) -> list[str]:
    """``"ddp,fsdp2"`` as ``["ddp", "fsdp2"]``: benchmark strategies (or variants, see
    :class:`~fsdp_strategy.tools.benchmark.options.Variant`), each at most once."""
    names = [name.strip() for name in text.split(",")]
    for name in names:
        parse_variant(name)
        if names.count(name) > 1:
            raise ValueError(f"`--strategies` names {name!r} more than once; got {text!r}.")
    return names


def validate(
    *,
    model: str | None,
    init_args: dict[str, Any] | None,
    size: str | None,
    strategies: Sequence[str],
    world_sizes: Sequence[int],
    precision: str,
    steps: int,
    warmup: int,
    repeats: int,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
) -> tuple[str, dict[str, Any]]:
    """Checks the options before any job starts (the model is imported later, by :func:`run_benchmark`);
    returns the model as ``MODULE:Class`` and its constructor arguments."""
    for option, value, low in (
        ("--steps", steps, 1),
        ("--warmup", warmup, 0),
        ("--repeats", repeats, 1),
        ("--batch-size", batch_size, 1),
        ("--seq-len", seq_len, 1),
        ("--vocab-size", vocab_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{option}` must be an integer >= {low}; got {value!r}.")
    if precision not in PRECISIONS:
        raise ValueError(f"`--precision` must be one of {', '.join(PRECISIONS)}; got {precision!r}.")
    parse_strategies(",".join(strategies))
    if not world_sizes or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in world_sizes):
        raise ValueError(f"`--world-sizes` must be positive integers; got {world_sizes!r}.")
    if model is not None and size is not None:
        raise ValueError(
            f"`--model` and `--size` exclude each other (`--size` picks the example GPT); got --model"
            f" {model!r} and --size {size!r}."
        )
    if model is None:
        if init_args is not None:
            raise ValueError("`--init-args` goes with `--model`; the example GPT's arguments come from `--size`.")
        size = size or "small"
        if size not in GPT_SIZES:
            raise ValueError(f"`--size` must be one of {', '.join(GPT_SIZES)}; got {size!r}.")
        return GPT_SPEC, {**GPT_SIZES[size], "vocab_size": vocab_size, "block_size": seq_len}
    return model, dict(init_args or {})


def interleaved_jobs(strategies: Sequence[str], world_sizes: Sequence[int], repeats: int) -> list[Job]:
    """Round r runs every configuration once, world size by world size, the strategies rotated by r."""
    jobs, strategies = [], list(strategies)
    for repeat in range(repeats):
        shift = repeat % len(strategies)
        for world_size in world_sizes:
            jobs += [Job(s, world_size, repeat) for s in strategies[shift:] + strategies[:shift]]
    return jobs


def run_benchmark(
    *,
    model: str | None = None,
    init_args: dict[str, Any] | None = None,
    size: str | None = None,
    strategies: Sequence[str] = STRATEGIES,
    world_sizes: Sequence[int] = (2,),
    precision: str = "32-true",
    steps: int = 20,
    warmup: int = 5,
    repeats: int = 3,
    batch_size: int = 8,
    seq_len: int = 128,
    vocab_size: int = 256,
    baseline: str | None = None,
    out: str | Path = "benchmark_results",
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Runs every job (``baseline``: a strategy of ``strategies`` that the others are also compared with, round
    by round), writes ``results.csv``, ``results.json`` and ``plot.png`` to ``out``, prints the
    summary table and returns the summary (one entry per strategy and world size)."""
    spec, model_args = validate(
        model=model,
        init_args=init_args,
        size=size,
        strategies=strategies,
        world_sizes=world_sizes,
        precision=precision,
        steps=steps,
        warmup=warmup,
        repeats=repeats,
        batch_size=batch_size,
        seq_len=seq_len,
        vocab_size=vocab_size,
    )
    if baseline is not None and baseline not in strategies:
        raise ValueError(f"`--baseline` must be one of the --strategies ({', '.join(strategies)}); got {baseline!r}.")
    require_extras()
    load_model_class(spec)  # a wrong --model fails here, once, not in every job
    worker_args = [
        "--model",
        spec,
        "--init-args",
        json.dumps(model_args),
        "--precision",
        precision,
        "--batch-size",
        str(batch_size),
        "--seq-len",
        str(seq_len),
        "--vocab-size",
        str(vocab_size),
        "--warmup",
        str(warmup),
        "--steps",
        str(steps),
    ]
    rows = _run_jobs(interleaved_jobs(strategies, world_sizes, repeats), worker_args, progress=progress)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows, baseline)
    config = _config(
        spec,
        model_args,
        rows,
        strategies=strategies,
        world_sizes=world_sizes,
        precision=precision,
        steps=steps,
        warmup=warmup,
        repeats=repeats,
        batch_size=batch_size,
        seq_len=seq_len,
        baseline=baseline,
    )
    write_csv(rows, out / "results.csv")
    write_json(rows, summary, config, out / "results.json")
    plot(summary, out / "plot.png", title=config["title"])
    print(config["title"])
    print(format_table(summary))
    print(f"wrote {out / 'results.csv'}, {out / 'results.json'} and {out / 'plot.png'}")
    return summary


def _run_jobs(jobs: list[Job], worker_args: list[str], *, progress: bool) -> list[dict[str, Any]]:
    from tqdm import tqdm

    rows = []
    with tqdm(jobs, desc="benchmark", unit="run", disable=not progress, position=0) as bar:
        for job in bar:
            bar.set_postfix_str(f"{job.strategy} on {job.world_size} rank(s), repeat {job.repeat + 1}")
            rows += [{**row, "repeat": job.repeat} for row in _launch(job, worker_args, progress=progress)]
    return rows


def _launch(job: Job, worker_args: list[str], *, progress: bool) -> list[dict[str, Any]]:
    """One fresh torchrun job; returns its ranks' rows. Its batches advance a second progress bar."""
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="fsdp-benchmark-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={job.world_size}",
            "-m",
            "fsdp_strategy.tools.benchmark.worker",
            "--strategy",
            job.strategy,
            *worker_args,
            "--out",
            tmp,
        ]
        tail: collections.deque[str] = collections.deque(maxlen=40)
        with (
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_environment()
            ) as proc,
            tqdm(
                desc=f"  {job.strategy} x{job.world_size}", unit="batch", disable=not progress, position=1, leave=False
            ) as bar,
        ):
            for line in proc.stdout:  # type: ignore[union-attr]
                if line.startswith(PROGRESS_PREFIX):
                    done, total = map(int, line.split()[-1].split("/"))
                    bar.total = total
                    bar.update(done - bar.n)
                else:
                    tail.append(line.rstrip())
        files = sorted(Path(tmp).glob("rank*.json"))
        if len(files) != job.world_size:
            raise RuntimeError(
                f"the {job.strategy} run on {job.world_size} rank(s) (repeat {job.repeat + 1}) failed with exit code"
                f" {proc.returncode}:\n  {' '.join(cmd)}\n" + "\n".join(tail)
            )
        return [json.loads(f.read_text()) for f in files]


def _environment() -> dict[str, str]:
    # The worker must import this package (and the user's model module) however it was installed.
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}


def _config(spec: str, model_args: dict[str, Any], rows: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    import lightning
    import torch

    params = rows[0]["params"]
    name = "example GPT" if spec == GPT_SPEC else spec
    title = (
        f"{name}, {params / 1e6:.1f}M parameters, {options['precision']}, AdamW;"
        f" {options['batch_size']} x {options['seq_len']} tokens per rank and step; CPU (gloo), 1 thread per rank;"
        f" median of {options['repeats']} repeat{'s' if options['repeats'] > 1 else ''}"
    )
    # glibc's mmap threshold moves peak host memory by a quarter to a third on CPU (docs/benchmarks.md): say when it was set.
    mmap_threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if mmap_threshold is not None:
        title += f"; MALLOC_MMAP_THRESHOLD_={mmap_threshold}"
    return {
        "command": " ".join(["fsdp-strategy", "benchmark", *sys.argv[2:]]) if sys.argv[1:2] == ["benchmark"] else None,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": spec,
        "init_args": model_args,
        "params": params,
        **options,
        "title": title,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "backend": "gloo",
            "threads_per_rank": 1,
            "malloc_mmap_threshold": mmap_threshold,
        },
        "jobs_in_order": [asdict(Job(r["strategy"], r["world_size"], r["repeat"])) for r in rows if r["rank"] == 0],
    }
