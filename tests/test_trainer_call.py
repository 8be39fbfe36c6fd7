"""The ``weights_only`` of ``trainer.fit``/``validate`` reaches ``FSDP2Strategy.load_checkpoint``.

Lightning drops it for strategies that restore after setup; ``fsdp_strategy._compat.weights_only_of_trainer_call``
recovers it.
"""

from __future__ import annotations

import dataclasses
import enum

import lightning
import pytest
import torch

import fsdp_strategy
from fsdp_strategy import CheckpointError
from fsdp_strategy._compat import weights_only_of_trainer_call
from fsdp_strategy.testing.models import TinyLM, token_loader


class Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass
class Config:
    mode: Mode = Mode.FAST


class ConfiguredLM(TinyLM):
    def __init__(self, config: Config = Config()) -> None:
        super().__init__(n_layer=1)
        self.save_hyperparameters()


class Probe(lightning.Callback):
    """What the strategy would see while the Trainer call runs."""

    def __init__(self) -> None:
        self.seen: list[bool | None] = []

    def on_fit_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self.seen.append(weights_only_of_trainer_call())

    on_validation_start = on_fit_start


def trainer(max_steps: int, *callbacks: lightning.Callback) -> lightning.Trainer:
    return lightning.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=fsdp_strategy.FSDP2Strategy(state_dict_type="sharded"),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=1,
        callbacks=list(callbacks),
    )


def test_weights_only_given_to_the_trainer_call_reaches_the_sharded_load(trainer_env, tmp_path):
    assert weights_only_of_trainer_call() is None  # no Trainer call running
    first = trainer(2)
    first.fit(ConfiguredLM(), token_loader(samples=16))
    first.save_checkpoint(tmp_path / "ck")

    for weights_only, expected in ((None, None), (False, False), (True, True)):
        trainer_env.fresh()
        probe = Probe()
        trainer(2, probe).validate(ConfiguredLM(), token_loader(samples=8), weights_only=weights_only)
        assert probe.seen == [expected]

    trainer_env.fresh()
    with pytest.raises(CheckpointError, match=r"'meta.pt' holds objects of types that are only loaded from a trusted file: "):
        trainer(4).fit(ConfiguredLM(), token_loader(samples=16), ckpt_path=tmp_path / "ck")
    trainer_env.fresh()
    with pytest.raises(CheckpointError, match="add_safe_globals"):
        trainer(4).validate(ConfiguredLM(), token_loader(samples=8), ckpt_path=tmp_path / "ck", weights_only=True)
    trainer_env.fresh()
    resumed = trainer(4)
    resumed.fit(ConfiguredLM(), token_loader(samples=16), ckpt_path=tmp_path / "ck", weights_only=False)
    assert resumed.global_step == 4
    trainer_env.fresh()
    with torch.serialization.safe_globals([Config, Mode]):
        trainer(4).validate(ConfiguredLM(), token_loader(samples=8), ckpt_path=tmp_path / "ck")


def deeper_hook(weights_only: bool = True) -> bool | None:
    """What a hook deeper in the call sees; its own local of that name is not the Trainer call's."""
    return weights_only_of_trainer_call()


def test_the_value_is_read_from_the_trainer_run_frame_alone(monkeypatch):
    from lightning.pytorch.trainer.trainer import Trainer

    def _run(self, weights_only):  # stands for Trainer._run, with the local of that name
        return deeper_hook()

    assert deeper_hook(False) is None  # no Trainer._run frame on the stack
    monkeypatch.setattr(Trainer, "_run", _run)
    assert [_run(None, value) for value in (True, False, None)] == [True, False, None]
    assert _run(None, "no") is None  # not a bool: torch's default applies
