"""The ``weights_only`` of ``trainer.fit``/``validate`` reaches ``FSDP2Strategy.load_checkpoint``, as Lightning
passes it to strategies that restore before setup (as DDP does); left unset, objects are refused as torch.load does.
"""

from __future__ import annotations

import dataclasses
import enum

import lightning
import pytest
import torch

import fsdp_strategy
from fsdp_strategy import CheckpointError
from testkit.models import TinyLM, token_loader


class Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass
class Config:
    mode: Mode = Mode.FAST


class ConfiguredLM(TinyLM):
    def __init__(self, config: Config = Config()) -> None:  # noqa: B008  (a config-object default, as users write it)
        super().__init__(n_layer=1)
        self.save_hyperparameters()


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
    first = trainer(2)
    first.fit(ConfiguredLM(), token_loader(samples=16))
    first.save_checkpoint(tmp_path / "ck")

    trainer_env.fresh()
    with pytest.raises(
        CheckpointError, match=r"'meta.pt' holds objects of types that are only loaded from a trusted file: "
    ):
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
