"""The ``fsdp-strategy`` command."""

from __future__ import annotations

import pytest

import fsdp_strategy
from fsdp_strategy.tools.cli import main


def test_env_prints_version_registered_names_and_precisions(capsys):
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"fsdp-strategy {fsdp_strategy.__version__}"
    assert (
        "strategy names: fsdp2, fsdp2_find_unused_parameters_true, fsdp2_grad_op, fsdp2_hybrid, fsdp2_offload,"
        " fsdp2_tp" in lines
    )
    assert "precisions: 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true" in lines
    assert any(line.startswith("CUDA devices: ") for line in lines)


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err


def test_unknown_command_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'train'" in capsys.readouterr().err
