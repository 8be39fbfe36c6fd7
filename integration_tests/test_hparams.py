"""Hyper-parameters that are objects: what DDP saves, FSDP2 saves and resumes with the same flags.

One torchrun launch on 2 processes (``integration_tests/hparams_worker.py``): a LightningModule whose
``__init__`` takes a dataclass holding an enum, a ``pathlib.Path``, a namedtuple and a nested OmegaConf
config calls ``self.save_hyperparameters()`` and trains 4 steps with ``ModelCheckpoint(every_n_train_steps=2)``
under "ddp" and under "fsdp2" (sharded); each checkpoint is resumed to 8 steps in several ways.
"""

from __future__ import annotations

from pathlib import Path

import torch

from integration_tests.conftest import max_relative_difference, torchrun

UNPICKLING_ERROR = "_pickle.UnpicklingError"
CHECKPOINT_ERROR = "fsdp_strategy.checkpoint.errors.CheckpointError"


def test_object_hyper_parameters_save_resume_and_consolidate_as_under_ddp(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    out = tmp_path / "results.pt"
    torchrun(
        "integration_tests.hparams_worker",
        ["--checkpoint-dir", str(checkpoints), "--out", str(out)],
        nproc=2,
        cwd=tmp_path,
    )
    results = torch.load(out, weights_only=True)  # plain data: the worker describes its objects
    params, errors = results["params"], results["errors"]
    saved = checkpoints / "fsdp2" / "epoch=0-step=4.ckpt"

    # Both save every 2 steps; the FSDP2 checkpoints are sharded directories.
    assert results["saved"] == {name: ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"] for name in ("ddp", "fsdp2")}
    assert (saved / "meta.pt").is_file() and (saved / ".metadata").is_file()

    # Trusted (weights_only=False), each resumes to the same parameters as DDP's resume; so does FSDP2 from
    # DDP's file (Lightning drops weights_only for strategies that restore after setup; the strategy recovers it).
    reference = params["ddp/weights_only=False"]
    for run in ("fsdp2/weights_only=False", "fsdp2 from ddp's file/weights_only=False"):
        assert max_relative_difference(params[run], reference) <= 1e-5, run

    # By default (Lightning passes weights_only=None, torch's default is True) DDP's resume fails on every
    # rank with torch's refusal; FSDP2's is refused on every rank, naming checkpoint, file, types and fixes.
    assert [error[0] for error in errors["ddp/fit"]] == [UNPICKLING_ERROR] * 2
    assert all("Weights only load failed" in error[1] for error in errors["ddp/fit"])
    refusals = errors["fsdp2/fit"]
    assert [error[0] for error in refusals] == [CHECKPOINT_ERROR] * 2 and refusals[0][1] == refusals[1][1]
    message = refusals[0][1]
    assert message.startswith(
        f"Checkpoint '{saved}' is refused: 'meta.pt' holds objects of types that are only loaded from a trusted file:"
        " __main__.Mode, __main__.Span, __main__.TrainConfig, "
    )
    assert "omegaconf.dictconfig.DictConfig" in message and "pathlib" not in message  # paths are accepted
    assert "trainer.fit(model, ckpt_path=..., weights_only=False)" in message
    assert "torch.serialization.add_safe_globals([Mode, Span, TrainConfig, " in message
    # validate/test/predict take the same switch.
    assert errors["fsdp2/validate"] == refusals
    assert errors["fsdp2/validate weights_only=False"] == [None, None]

    # The types registered with torch instead: both resume by default, to the same parameters. DDP also
    # needs pathlib's class registered; FSDP2 accepts paths without it.
    assert max_relative_difference(params["fsdp2/safe_globals"], params["ddp/safe_globals"]) <= 1e-5
    assert max_relative_difference(params["fsdp2/safe_globals"], reference) <= 1e-5
    ddp_without_path = errors["ddp/fit safe_globals without the path"]
    assert [error[0] for error in ddp_without_path] == [UNPICKLING_ERROR] * 2
    assert all("GLOBAL pathlib.PosixPath" in error[1] for error in ddp_without_path)

    # Consolidated (trusting the directory; refused by default as the resume is), the file gives
    # load_from_checkpoint(..., weights_only=False) the same hyper-parameters as DDP's file, type by type;
    # by default both files are refused by torch alike.
    assert results["errors"]["consolidate"] == (CHECKPOINT_ERROR, message)
    ddp_hparams, consolidated_hparams = results["hparams"]["ddp"], results["hparams"]["consolidated"]
    assert consolidated_hparams == ddp_hparams
    types = {where: kind for where, kind, _ in ddp_hparams}
    assert types["hparams['config']"] == "__main__.TrainConfig"
    assert types["hparams['config'].mode"] == "__main__.Mode"
    path_class = type(Path("/data"))
    assert types["hparams['config'].data_dir"] == f"{path_class.__module__}.{path_class.__qualname__}"
    assert types["hparams['config'].span"] == "__main__.Span"
    assert types["hparams['config'].model"] == "omegaconf.dictconfig.DictConfig"
    assert types["hparams['config'].model['optim']['betas']"] == "omegaconf.listconfig.ListConfig"
    assert {key: error[0] for key, error in results["load_default"].items()} == {
        "ddp": UNPICKLING_ERROR,
        "consolidated": UNPICKLING_ERROR,
    }
