"""``fsdp-strategy benchmark``: option checks and the report on made-up rows (a real run: integration_tests/test_benchmark_run.py)."""

from __future__ import annotations

import ast
import csv
import json
import re
from pathlib import Path

import pytest

import fsdp_strategy.tools.benchmark
from fsdp_strategy.tools.benchmark.report import (
    CSV_FIELDS,
    format_table,
    plot,
    summarize,
    write_csv,
    write_json,
)
from fsdp_strategy.tools.benchmark.run import (
    Job,
    interleaved_jobs,
    parse_strategies,
    require_extras,
    run_benchmark,
    validate,
)
from fsdp_strategy.tools.cli import main

GOOD = dict(
    model=None,
    init_args=None,
    size=None,
    strategies=["ddp", "fsdp2"],
    world_sizes=[2],
    precision="32-true",
    steps=2,
    warmup=1,
    repeats=1,
    batch_size=2,
    seq_len=16,
    vocab_size=256,
)


def check(**changes):
    return validate(**{**GOOD, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"steps": 0}, "`--steps` must be an integer >= 1; got 0."),
        ({"warmup": -1}, "`--warmup` must be an integer >= 0; got -1."),
        ({"repeats": True}, "`--repeats` must be an integer >= 1; got True."),
        ({"batch_size": 0}, "`--batch-size` must be an integer >= 1; got 0."),
        ({"precision": "16-true"}, "`--precision` must be one of 32-true, bf16-mixed; got '16-true'."),
        (
            {"strategies": ["ddp", "fsdp"]},
            "`--strategies`: 'fsdp' is not one of ddp, fsdp2, fsdp2_grad_op, model_parallel, raw_fsdp2.",
        ),
        ({"strategies": ["ddp", "ddp"]}, "`--strategies` names 'ddp' more than once; got 'ddp,ddp'."),
        ({"world_sizes": [2, 0]}, "`--world-sizes` must be positive integers; got [2, 0]."),
        (
            {"model": "pkg:Net", "size": "tiny"},
            "`--model` and `--size` exclude each other (`--size` picks the example GPT); got --model 'pkg:Net' and"
            " --size 'tiny'.",
        ),
        (
            {"init_args": {"n_layer": 2}},
            "`--init-args` goes with `--model`; the example GPT's arguments come from `--size`.",
        ),
        ({"size": "huge"}, "`--size` must be one of tiny, small, medium, large; got 'huge'."),
    ],
)
def test_bad_options_are_named_with_the_value_and_what_is_accepted(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check(**changes)


def test_a_size_becomes_the_example_gpt_with_the_sequence_length_as_block_size():
    assert check(size="tiny") == (
        "fsdp_strategy.tools.benchmark.gpt:GPT",
        {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256, "block_size": 16},
    )
    assert check(model="my.models:Net", init_args={"width": 3}) == ("my.models:Net", {"width": 3})


def test_strategies_are_parsed_in_order():
    assert parse_strategies("raw_fsdp2, ddp") == ["raw_fsdp2", "ddp"]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return names | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}


def test_the_launcher_and_the_worker_do_not_import_each_other():
    # The launcher starts the worker by module name in fresh processes; what both need is in options.py.
    package = Path(fsdp_strategy.tools.benchmark.__file__).parent
    assert "fsdp_strategy.tools.benchmark.worker" not in imported_modules(package / "run.py")
    assert "fsdp_strategy.tools.benchmark.run" not in imported_modules(package / "worker.py")


def test_a_missing_extra_names_the_module_and_the_install_command():
    require_extras()  # installed here
    with pytest.raises(ImportError) as error:
        require_extras(("tqdm", "no_such_module_xyz"))
    assert str(error.value) == (
        "fsdp-strategy benchmark needs tqdm, no_such_module_xyz; not installed: no_such_module_xyz."
        " Install them with: pip install 'fsdp-strategy[benchmarks]'"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-sizes", "2,0"], "`--world-sizes` must be comma-separated positive ints such as 1,2,4,8; got '2,0'."),
        (
            ["--strategies", "ddp,zero3"],
            "`--strategies`: 'zero3' is not one of ddp, fsdp2, fsdp2_grad_op, model_parallel, raw_fsdp2.",
        ),
        (
            ["--model", "torch.nn:Linear"],
            "`--model` 'torch.nn:Linear' must name a LightningModule subclass; it is"
            " <class 'torch.nn.modules.linear.Linear'>.",
        ),
        (
            ["--model", "pkg.Net"],
            "The model must be given as 'MODULE:Class' (for example 'examples.gpt:GPT') or a class; got 'pkg.Net'.",
        ),
    ],
)
def test_the_command_reports_a_bad_option_and_exits_with_2(argv, message, capsys):
    assert main(["benchmark", *argv]) == 2
    assert capsys.readouterr().err.startswith(f"fsdp-strategy benchmark: error: {message}")


def test_repeats_are_interleaved_and_rotated():
    jobs = interleaved_jobs(["a", "b", "c"], [2, 4], repeats=2)
    assert [(j.strategy, j.world_size, j.repeat) for j in jobs] == [
        ("a", 2, 0),
        ("b", 2, 0),
        ("c", 2, 0),
        ("a", 4, 0),
        ("b", 4, 0),
        ("c", 4, 0),
        ("b", 2, 1),
        ("c", 2, 1),
        ("a", 2, 1),
        ("b", 4, 1),
        ("c", 4, 1),
        ("a", 4, 1),
    ]
    assert jobs[0] == Job("a", 2, 0)


# --- the report, on made-up rows ------------------------------------------------------------------------------------

MiB = 2**20


def row(strategy, world_size, repeat, rank, *, growth, step, state=100 * MiB):
    return {
        "strategy": strategy,
        "world_size": world_size,
        "repeat": repeat,
        "rank": rank,
        "params": 1000,
        "precision": "32-true",
        "batch_size": 2,
        "seq_len": 8,
        "rss_after_imports_bytes": 400 * MiB,
        "peak_rss_bytes": 400 * MiB + growth,
        "growth_bytes": growth,
        "train_growth_bytes": growth - MiB,
        "stage_end_s": step * (1 + rank),
        "model_state_bytes": state,
        "model_state_total_bytes": 200 * MiB,
        "model_state_over_ideal": state / (200 * MiB / world_size),
        "step_time_s": step,
        "cpu_time_s": step / 2,
        "samples_per_s": world_size * 2 / step,
        "tokens_per_s": world_size * 16 / step,
        "loss_last": 5.5,
        "step_times_s": [step, step],
    }


@pytest.fixture
def rows():
    made_up = []
    for repeat, (ddp, fsdp2, raw) in enumerate([(1000, 500, 480), (1100, 540, 520), (900, 520, 470)]):
        for rank in (0, 1):
            made_up.append(row("ddp", 2, repeat, rank, growth=ddp * MiB, step=0.10, state=200 * MiB))
            made_up.append(row("fsdp2", 2, repeat, rank, growth=(fsdp2 + 10 * rank) * MiB, step=0.11 + 0.01 * rank))
            made_up.append(row("raw_fsdp2", 2, repeat, rank, growth=raw * MiB, step=0.10))
    return made_up


def test_summary_takes_the_worst_rank_then_medians_and_paired_ratios_over_repeats(rows):
    summary = {e["strategy"]: e for e in summarize(rows)}
    assert list(summary) == ["ddp", "fsdp2", "raw_fsdp2"]
    fsdp2 = summary["fsdp2"]
    assert fsdp2["repeats"] == 3
    assert fsdp2["growth_bytes"] == 530 * MiB  # worst ranks 510, 550, 530
    assert (fsdp2["growth_bytes_min"], fsdp2["growth_bytes_max"]) == (510 * MiB, 550 * MiB)
    assert fsdp2["growth_over_ddp"] == pytest.approx(sorted([510 / 1000, 550 / 1100, 530 / 900])[1])
    assert fsdp2["step_time_s"] == pytest.approx(0.12)
    assert fsdp2["stage_end_s"] == pytest.approx(2 * 0.12)  # the slower rank's give-back, as fit waits for it
    assert fsdp2["step_time_over_raw_fsdp2"] == pytest.approx(1.2)
    assert fsdp2["step_time_over_model_parallel"] is None  # not run
    assert fsdp2["model_state_over_ideal"] == pytest.approx(1.0)
    assert summary["ddp"]["model_state_over_ideal"] == pytest.approx(2.0)
    assert summary["ddp"]["growth_over_ddp"] == 1.0
    assert fsdp2["tokens_per_s"] == pytest.approx(32 / 0.12)


def test_csv_json_table_and_plot_are_written(rows, tmp_path):
    summary = summarize(rows)
    write_csv(rows, tmp_path / "results.csv")
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == CSV_FIELDS and len(table) == len(rows)
    write_json(rows, summary, {"model": "m"}, tmp_path / "results.json")
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data) == {"config", "summary", "rows"} and data["rows"][0]["step_times_s"] == [0.1, 0.1]
    text = format_table(summary)
    assert text.splitlines()[2].startswith("| ddp | 2 | 1,000 | 1.000 | 200.0 | 2.000 | 100.0 | 1.000 | - |")
    plot(summary, tmp_path / "plot.png", title="made-up numbers")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- one real run ---------------------------------------------------------------------------------------------------


def test_variants_carry_strategy_options_and_meta_init():
    from fsdp_strategy.tools.benchmark.options import Variant, parse_variant

    assert parse_variant("fsdp2:host_memory=release:init=meta") == Variant("fsdp2", {"host_memory": "release"}, "meta")
    assert parse_variant("fsdp2_grad_op:reshard_after_forward=2") == Variant(
        "fsdp2_grad_op", {"reshard_after_forward": 2}
    )
    assert parse_strategies("ddp,fsdp2:host_memory=keep") == ["ddp", "fsdp2:host_memory=keep"]
    for text, message in [
        ("ddp:host_memory=keep", "only fsdp2, fsdp2_grad_op take ':option=value' settings"),
        ("fsdp2:init=lazy", "init must be one of eager, meta; got 'lazy'"),
        ("fsdp2:keep", "settings are ':option=value'; got 'keep'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_variant(text)
    with pytest.raises(
        ValueError, match=re.escape("`--baseline` must be one of the --strategies (ddp, fsdp2); got 'x'.")
    ):
        run_benchmark(size="tiny", strategies=["ddp", "fsdp2"], baseline="x", progress=False)
