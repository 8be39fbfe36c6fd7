"""The table ``fsdp-strategy estimate`` prints, from made-up rows (no model needed)."""

from __future__ import annotations

from fsdp_strategy.estimator.model_state import Estimate
from fsdp_strategy.estimator.report import EstimateReport, Recommendation, render_table

KiB, MiB = 2**10, 2**20
PEAK_NOTE = (
    "* peak: model state + gathered units and unsharded gradients (DDP: gradient buckets); activations not included."
)
DDP = Estimate("ddp", 2, (2, 1), 4 * MiB, 4 * MiB, 8 * MiB, 0, 0, 0, 4 * MiB, 0, working_bytes=4 * MiB)


def test_names_left_sizes_right_zero_as_a_dash_and_a_world_size_with_only_skipped_rows():
    fsdp2 = Estimate(
        "fsdp2", 2, (1, 2), 2 * MiB, 2 * MiB, 4 * MiB, 512 * KiB, 3 * MiB, 4 * MiB, 0, 0, working_bytes=1536 * KiB
    )
    offload = Estimate(
        "fsdp2_offload",
        2,
        (1, 2),
        0,
        0,
        0,
        512 * KiB,
        3 * MiB,
        4 * MiB,
        0,
        8 * MiB,
        working_bytes=1536 * KiB,
        note="CUDA only",
    )
    report = EstimateReport(
        "Net",
        1000,
        "32-true",
        "adamw",
        None,
        [DDP, fsdp2, offload],
        skipped=[("fsdp2_hybrid", 3, "no node size divides 3")],
    )
    assert render_table(report).splitlines() == [
        "Net: 1,000 parameters, precision 32-true, optimizer adamw",
        "Bytes per rank; communication in full-size bytes per optimizer step.",
        "",
        "world size 2",
        "strategy       mesh   params    grads  optimizer  largest unit     peak*  all-gather  reduce-scatter  all-reduce     host",
        "ddp            2x1   4.0 MiB  4.0 MiB    8.0 MiB             -  20.0 MiB           -               -     4.0 MiB        -",
        "fsdp2          1x2   2.0 MiB  2.0 MiB    4.0 MiB     512.0 KiB   9.5 MiB     3.0 MiB         4.0 MiB           -        -",
        "fsdp2_offload  1x2         -        -          -     512.0 KiB   1.5 MiB     3.0 MiB         4.0 MiB           -  8.0 MiB",
        "  fsdp2_offload: CUDA only",
        "",
        "world size 3",
        "  fsdp2_hybrid: skipped: no node size divides 3",
        "",
        PEAK_NOTE,
        "Pass a budget (--budget 80GiB) for a recommendation.",
    ]


def test_with_a_budget_the_recommendations_close_the_table():
    recommendations = [Recommendation(2, None, "nothing fits"), Recommendation(4, "fsdp2", "it fits")]
    report = EstimateReport("Net", 1234567, "bf16-mixed", "sgd", 10 * MiB, [DDP], recommendations=recommendations)
    assert report.table() == render_table(report)
    assert render_table(report).splitlines()[-4:] == [
        "",
        PEAK_NOTE,
        "world size 2: none fits (nothing fits)",
        "world size 4: fsdp2 (it fits)",
    ]
