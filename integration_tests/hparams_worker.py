"""Hyper-parameters that are objects (a dataclass holding an enum, a path, a namedtuple and an OmegaConf
config), saved by ModelCheckpoint and resumed under "ddp" and "fsdp2", as a user's script has them.

Launched by torchrun on 2 processes. The config classes live in this script (``__main__``), as they
do in a user's training script, so everything that unpickles them happens here; rank 0 writes what the
test compares (final parameters, the errors of every rank, the restored hyper-parameters described by
type and value) to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import typing
from pathlib import Path, PosixPath
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.base import ContainerMetadata, Metadata
from omegaconf.nodes import AnyNode
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

import fsdp_strategy
from testkit.models import TinyLM, token_loader


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


Span = collections.namedtuple("Span", "start stop")


@dataclasses.dataclass
class TrainConfig:
    mode: Mode
    data_dir: Path
    span: Span
    model: DictConfig


class ConfiguredLM(TinyLM):
    def __init__(self, config: TrainConfig) -> None:
        super().__init__(n_layer=config.model.n_layer, lr=config.model.optim.lr)
        self.save_hyperparameters()


def make_config() -> TrainConfig:
    model = OmegaConf.create({"n_layer": 2, "optim": {"lr": 1e-2, "betas": [0.9, 0.99]}})
    return TrainConfig(mode=Mode.SLOW, data_dir=Path("/data/tokens"), span=Span(0, 8), model=model)


def strategy(name: str) -> Any:
    return fsdp_strategy.FSDP2Strategy(state_dict_type="sharded") if name == "fsdp2" else "ddp"


def trainer(name: str, max_steps: int, checkpoint_dir: Path | None = None) -> L.Trainer:
    callbacks = (
        [ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=2, save_top_k=-1)] if checkpoint_dir else []
    )
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy(name),
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
    )


def final_params(model: L.LightningModule) -> dict[str, torch.Tensor]:
    if any(isinstance(p, DTensor) for p in model.parameters()):
        params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        params = model.state_dict()
    return {key: value.detach().float().cpu() for key, value in params.items()}


def resume(name: str, ckpt_path: Path, **weights_only: Any) -> dict[str, torch.Tensor]:
    L.seed_everything(42)
    model = ConfiguredLM(make_config())
    trainer(name, max_steps=8).fit(model, token_loader(), ckpt_path=ckpt_path, **weights_only)
    return final_params(model)


def error_on_every_rank(action: Any) -> list[tuple[str, str] | None]:
    """``(type, message)`` of the error ``action`` raised on each rank (``None``: it did not raise)."""
    try:
        action()
        mine = None
    except Exception as error:
        mine = (f"{type(error).__module__}.{type(error).__qualname__}", str(error))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def error_of(action: Any) -> tuple[str, str] | None:
    """``(type, message)`` of the error ``action`` raised in this process (``None``: it did not raise)."""
    try:
        action()
    except Exception as error:
        return f"{type(error).__module__}.{type(error).__qualname__}", str(error)
    return None


def describe(value: Any, where: str = "hparams") -> list[tuple[str, str, str]]:
    """``(key path, type, repr)`` of ``value`` and everything inside it."""
    kind = type(value)
    rows = [(where, f"{kind.__module__}.{kind.__qualname__}", repr(value))]
    if isinstance(value, (dict, DictConfig)):
        for key in value:
            rows += describe(value[key], f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, ListConfig)):
        for index, item in enumerate(value):
            rows += describe(item, f"{where}[{index}]")
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            rows += describe(getattr(value, field.name), f"{where}.{field.name}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results: dict[str, Any] = {"params": {}, "errors": {}}

    # 4 steps, saved by ModelCheckpoint every 2 steps: DDP files and FSDP2 sharded directories.
    for name in ("ddp", "fsdp2"):
        L.seed_everything(42)
        trainer(name, max_steps=4, checkpoint_dir=args.checkpoint_dir / name).fit(
            ConfiguredLM(make_config()), token_loader()
        )
    dist.barrier()
    saved = {name: args.checkpoint_dir / name / "epoch=0-step=4.ckpt" for name in ("ddp", "fsdp2")}
    results["saved"] = {name: sorted(p.name for p in (args.checkpoint_dir / name).iterdir()) for name in saved}

    # Resumed to 8 steps, trusting the checkpoints.
    for name in ("ddp", "fsdp2"):
        results["params"][f"{name}/weights_only=False"] = resume(name, saved[name], weights_only=False)
    results["params"]["fsdp2 from ddp's file/weights_only=False"] = resume("fsdp2", saved["ddp"], weights_only=False)
    # By default (Lightning passes weights_only=None; torch's default is True): refused.
    for name in ("ddp", "fsdp2"):
        results["errors"][f"{name}/fit"] = error_on_every_rank(lambda name=name: resume(name, saved[name]))
    results["errors"]["fsdp2/validate"] = error_on_every_rank(
        lambda: trainer("fsdp2", max_steps=8).validate(
            ConfiguredLM(make_config()), token_loader(), ckpt_path=saved["fsdp2"]
        )
    )
    validated = error_on_every_rank(
        lambda: trainer("fsdp2", max_steps=8).validate(
            ConfiguredLM(make_config()), token_loader(), ckpt_path=saved["fsdp2"], weights_only=False
        )
    )
    results["errors"]["fsdp2/validate weights_only=False"] = validated

    # One file from the sharded directory; load_from_checkpoint as from DDP's file.
    consolidated = args.checkpoint_dir / "fsdp2-consolidated.ckpt"
    if dist.get_rank() == 0:
        results["errors"]["consolidate"] = error_of(
            lambda: fsdp_strategy.consolidate_checkpoint(saved["fsdp2"], consolidated, progress=False)
        )
        fsdp_strategy.consolidate_checkpoint(saved["fsdp2"], consolidated, progress=False, weights_only=False)
        files = {"ddp": saved["ddp"], "consolidated": consolidated}
        results["hparams"] = {
            key: describe(dict(ConfiguredLM.load_from_checkpoint(path, weights_only=False).hparams))
            for key, path in files.items()
        }
        results["load_default"] = {
            key: error_of(lambda path=path: ConfiguredLM.load_from_checkpoint(path)) for key, path in files.items()
        }
    dist.barrier()

    # The user registers the types with torch instead: FSDP2 needs the types its message names ...
    omegaconf_types = [
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        AnyNode,
        typing.Any,
        dict,
        int,
        list,
        collections.defaultdict,
    ]
    torch.serialization.add_safe_globals([TrainConfig, Mode, Span, *omegaconf_types])
    results["params"]["fsdp2/safe_globals"] = resume("fsdp2", saved["fsdp2"])
    # ... and DDP's file also the path class, which fsdp_strategy accepts without registration.
    results["errors"]["ddp/fit safe_globals without the path"] = error_on_every_rank(
        lambda: resume("ddp", saved["ddp"])
    )
    torch.serialization.add_safe_globals([PosixPath])
    results["params"]["ddp/safe_globals"] = resume("ddp", saved["ddp"])

    if dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
