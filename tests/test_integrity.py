"""Integrity checks of sharded checkpoints: damaged, half-written, unsafe and foreign ones are refused by name.

The checkpoint under test is a real one: a 1-device ``Trainer(strategy="fsdp2")`` fit of a TinyLM with
hyper-parameters, an LR scheduler and a ModelCheckpoint, saved by ``trainer.save_checkpoint`` once per
module and copied for each test. Payloads of the "malicious" files write a marker file when unpickled;
each such test first proves on a second copy that the payload is live, then that it was not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pickle
import re
import shutil
from collections import namedtuple
from pathlib import (
    Path,
    PosixPath,
    PurePath,
    PurePosixPath,
    PureWindowsPath,
    WindowsPath,
)
from typing import Any

import lightning
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fsdp_strategy
from fsdp_strategy.checkpoint import state_dicts as ckpt
from fsdp_strategy.checkpoint import writing
from fsdp_strategy.checkpoint.dcp_metadata import read_dcp_metadata
from fsdp_strategy.checkpoint.errors import CheckpointError
from fsdp_strategy.checkpoint.trainer_state import (
    ACCEPTED_TYPES,
    check_trainer_state,
    load_trainer_state,
    save_trainer_state,
)
from fsdp_strategy.checkpoint.verify import (
    check_model_matches,
    compare_keys,
    is_half_written,
    is_sharded_checkpoint,
    saved_shapes,
    verify_sharded_checkpoint,
)
from testkit.models import TinyLM, token_loader

SHARD = "__0_0.distcp"


class ScheduledLM(TinyLM):
    """TinyLM with saved hyper-parameters and a StepLR: what a typical Lightning checkpoint carries."""

    def __init__(
        self, n_layer: int = 2, lr: float = 1e-2, run_name: str = "integrity", betas: tuple = (0.9, 0.99)
    ) -> None:
        super().__init__(n_layer=n_layer, lr=lr)
        self.save_hyperparameters()

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
        }


class Payload:
    """Unpickling this writes ``marker``: stands for any code a hostile checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


def expect(message: str):
    return pytest.raises(CheckpointError, match=f"^{re.escape(message)}$")


@pytest.fixture(scope="module")
def pristine_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pristine")  # filled by the first test that asks for `saved`


@pytest.fixture
def saved(pristine_dir: Path, trainer_env, tmp_path: Path) -> Path:
    """A copy of a real sharded checkpoint written by the strategy after a 2-step fit."""
    source = pristine_dir / "ck"
    if not source.exists():
        trainer = lightning.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=fsdp_strategy.FSDP2Strategy(state_dict_type="sharded"),
            max_steps=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=pristine_dir / "best", monitor="train_loss")],
        )
        trainer.fit(ScheduledLM(), token_loader(samples=16))
        trainer.save_checkpoint(source)
        trainer_env.fresh()  # the Trainer's process group is not needed any more
    shutil.copytree(source, tmp_path / "ck")
    return tmp_path / "ck"


def assert_same(actual, expected, where: str = "state") -> None:
    assert type(actual) is type(expected), f"{where}: {type(actual)} vs {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


# --- a good checkpoint ----------------------------------------------------------------------------


def test_a_checkpoint_written_by_the_strategy_verifies_and_its_trainer_state_loads_back_equal(saved):
    verify_sharded_checkpoint(saved)
    assert is_sharded_checkpoint(saved) and not is_half_written(saved)

    state = load_trainer_state(saved)  # weights_only=True
    assert_same(state, torch.load(saved / "meta.pt", weights_only=False))
    assert state["hyper_parameters"] == {"n_layer": 2, "lr": 1e-2, "run_name": "integrity", "betas": (0.9, 0.99)}
    assert state["global_step"] == 2 and state["lr_schedulers"][0]["gamma"] == 0.5
    (checkpoint_state,) = [value for key, value in state["callbacks"].items() if key.startswith("ModelCheckpoint{")]
    assert isinstance(checkpoint_state["best_model_score"], torch.Tensor)

    # Written again through save_trainer_state, it is byte-for-byte the same data.
    save_trainer_state(saved, state)
    assert_same(load_trainer_state(saved), state)
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", SHARD, "meta.pt"]  # no temporary file left


# --- shard files ----------------------------------------------------------------------------------


def test_a_missing_shard_file(saved):
    (saved / SHARD).unlink()
    with expect(f"Checkpoint '{saved}' is damaged: shard file '{SHARD}' is missing (listed in .metadata)."):
        verify_sharded_checkpoint(saved)


def test_a_truncated_shard_file(saved):
    storage = read_dcp_metadata(saved).storage_data
    needed = max(info.offset + info.length for info in storage.values())
    with open(saved / SHARD, "r+b") as file:
        file.truncate(needed - 1)
    with expect(
        f"Checkpoint '{saved}' is damaged: shard file '{SHARD}' is truncated: {needed - 1} bytes, expected at least {needed}."
    ):
        verify_sharded_checkpoint(saved)


def test_a_shard_path_outside_the_checkpoint_is_refused(saved):
    metadata = read_dcp_metadata(saved)
    (index,) = [index for index in metadata.storage_data if index.fqn == "model.scale"]
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index], relative_path="../elsewhere.distcp"
    )
    (saved / ".metadata").write_bytes(pickle.dumps(metadata))
    with expect(
        f"Checkpoint '{saved}' is damaged: '.metadata' points 'model.scale' to '../elsewhere.distcp', outside the"
        " checkpoint directory."
    ):
        verify_sharded_checkpoint(saved)


def test_a_hostile_non_tensor_shard_entry_is_refused_without_running_it(tmp_path, single_rank_group):
    path = tmp_path / "ck"
    dcp.save({"model": {"w": torch.ones(2)}, "extra": Payload(tmp_path / "control")}, checkpoint_id=path)
    save_trainer_state(path, {"epoch": 0})
    # DCP's own loader unpickles non-tensor entries unrestricted: the payload is live.
    dcp.load({"model": {"w": torch.zeros(2)}, "extra": None}, checkpoint_id=path)
    assert (tmp_path / "control").exists()

    shutil.rmtree(path)
    dcp.save({"model": {"w": torch.ones(2)}, "extra": Payload(tmp_path / "marker")}, checkpoint_id=path)
    save_trainer_state(path, {"epoch": 0})
    with expect(refused_types(path, f"shard file '{SHARD}' holds 'extra' with", "builtins.exec", "exec")):
        verify_sharded_checkpoint(path)
    assert not (tmp_path / "marker").exists()


# --- DCP's .metadata ------------------------------------------------------------------------------


def test_garbage_bytes_as_dcp_metadata(saved):
    (saved / ".metadata").write_bytes(b"not a pickle at all")
    with expect(
        f"Checkpoint '{saved}' is damaged: '.metadata' is not a Distributed Checkpoint metadata file"
        " (unreadable pickle data: invalid load key, 'n')."
    ):
        verify_sharded_checkpoint(saved)


def test_a_pickle_of_another_type_as_dcp_metadata(saved):
    (saved / ".metadata").write_bytes(pickle.dumps({"epoch": 3, "weights": [1.0, 2.0]}))
    with expect(
        f"Checkpoint '{saved}' is damaged: '.metadata' is not a Distributed Checkpoint metadata file"
        " (it holds a dict, not a torch.distributed.checkpoint.metadata.Metadata)."
    ):
        verify_sharded_checkpoint(saved)


def test_a_truncated_dcp_metadata(saved):
    data = (saved / ".metadata").read_bytes()
    (saved / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=re.escape(f"Checkpoint '{saved}' is damaged: '.metadata' is not a Distributed")
    ):
        verify_sharded_checkpoint(saved)


def test_a_hostile_dcp_metadata_is_refused_without_running_it(saved, tmp_path):
    pickle.loads(pickle.dumps(Payload(tmp_path / "control")))  # what dcp.load's pickle.load would do
    assert (tmp_path / "control").exists()

    (saved / ".metadata").write_bytes(pickle.dumps(Payload(tmp_path / "marker")))
    with expect(
        f"Checkpoint '{saved}' is damaged: '.metadata' is not a Distributed Checkpoint metadata file"
        " (it refers to builtins.exec, which DCP metadata never contains; not unpickled)."
    ):
        verify_sharded_checkpoint(saved)
    assert not (tmp_path / "marker").exists()


def test_a_missing_dcp_metadata_is_a_half_written_checkpoint(saved):
    (saved / ".metadata").unlink()
    assert is_sharded_checkpoint(saved) and is_half_written(saved)
    with expect(
        f"Checkpoint '{saved}' is damaged: '.metadata' is missing (a save that was interrupted leaves the directory so)."
    ):
        verify_sharded_checkpoint(saved)


# --- meta.pt --------------------------------------------------------------------------------------


def test_a_missing_trainer_state_is_a_half_written_checkpoint(saved):
    (saved / "meta.pt").unlink()
    # Sharded all the same, so the strategy does not take it for a single-file checkpoint.
    assert is_sharded_checkpoint(saved) and is_half_written(saved)
    with expect(
        f"Checkpoint '{saved}' is damaged: 'meta.pt' is missing (a save that was interrupted leaves the directory so)."
    ):
        verify_sharded_checkpoint(saved)


def test_an_empty_trainer_state(saved):
    (saved / "meta.pt").write_bytes(b"")
    with expect(f"Checkpoint '{saved}' is damaged: 'meta.pt' is empty (0 bytes)."):
        verify_sharded_checkpoint(saved)


def test_a_truncated_trainer_state(saved):
    data = (saved / "meta.pt").read_bytes()
    (saved / "meta.pt").write_bytes(data[:-10])
    with expect(
        f"Checkpoint '{saved}' is damaged: 'meta.pt' is truncated or not written by torch.save (no complete archive"
        f" in its {len(data) - 10} bytes)."
    ):
        verify_sharded_checkpoint(saved)


def test_a_hostile_trainer_state_is_refused_without_running_it(saved, tmp_path):
    torch.save({"epoch": 1, "callbacks": {"Evil": Payload(tmp_path / "control")}}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)  # what the unchecked loader did
    assert (tmp_path / "control").exists()

    torch.save({"epoch": 1, "callbacks": {"Evil": Payload(tmp_path / "marker")}}, saved / "meta.pt")
    message = refused_types(saved, "'meta.pt' holds", "builtins.exec", "exec")
    with expect(message):
        verify_sharded_checkpoint(saved)
    with expect(message):
        load_trainer_state(saved)
    assert not (tmp_path / "marker").exists()


# --- hyper-parameters as DDP saves them -----------------------------------------------------------


class Mode(enum.Enum):
    FAST = "fast"


Span = namedtuple("Span", "start stop")


@dataclasses.dataclass
class TrainConfig:
    mode: Mode = Mode.FAST
    span: Span = Span(0, 8)
    data_dir: Path = Path("/data")


@dataclasses.dataclass
class Holder:
    content: Any = None


TRUST = (
    "If you trust this checkpoint, load it with weights_only=False: trainer.fit(model, ckpt_path=...,"
    " weights_only=False) (likewise validate, test and predict), consolidate_checkpoint(..., weights_only=False)"
    " or fsdp-strategy consolidate --no-weights-only."
)


def refused_types(checkpoint: Path, what: str, names: str, classes: str) -> str:
    return (
        f"Checkpoint '{checkpoint}' is refused: {what} objects of types that are only loaded from a trusted file: {names}"
        " (rebuilding an object runs code of its type, so torch.load(weights_only=True) rebuilds only the types it is"
        f" told are safe). {TRUST} Or, if they are your own types and safe to rebuild, register them in every process"
        f" before loading: torch.serialization.add_safe_globals([{classes}])."
    )


def test_hyper_parameters_are_saved_as_the_objects_themselves(saved):
    np = pytest.importorskip("numpy")
    omegaconf = pytest.importorskip("omegaconf")
    state = torch.load(saved / "meta.pt", weights_only=False)  # a real Lightning trainer state
    hyper_parameters = {
        "config": TrainConfig(),
        "mode": Mode.FAST,
        "span": Span(1, 2),
        "data_dir": Path("/data"),
        "model": omegaconf.OmegaConf.create({"width": 16, "blocks": [{"kind": "attn"}, {"kind": "mlp"}]}),
        "layers": omegaconf.OmegaConf.create([1, 2]),
        "args": argparse.Namespace(seed=3, files=[Path("a.txt")]),
        "extra": AttributeDict(depth=2),
        "scale": np.float32(0.5),
        "shape": torch.Size([2, 3]),
        "tags": {"a", "b"},
    }
    state["hyper_parameters"] = hyper_parameters
    save_trainer_state(saved, state)

    loaded = load_trainer_state(saved, weights_only=False)["hyper_parameters"]
    assert list(loaded) == list(hyper_parameters)
    for key, value in hyper_parameters.items():
        assert type(loaded[key]) is type(value) and loaded[key] == value, key
    assert type(loaded["config"].mode) is Mode and type(loaded["config"].span) is Span
    assert type(loaded["model"].blocks[0]) is omegaconf.DictConfig and loaded["model"].blocks[1].kind == "mlp"
    verify_sharded_checkpoint(saved, weights_only=False)


def test_paths_and_namespaces_load_without_registering_them(saved):
    assert ACCEPTED_TYPES == (
        argparse.Namespace,
        PurePath,
        PurePosixPath,
        PureWindowsPath,
        Path,
        PosixPath,
        WindowsPath,
    )
    hyper_parameters = {
        "data_dir": Path("/data"),
        "relative": PurePosixPath("runs/a"),
        "windows": PureWindowsPath("C:/data"),
        "args": argparse.Namespace(seed=3, nested=argparse.Namespace(files=[Path("a.txt")])),
    }
    save_trainer_state(saved, {**load_trainer_state(saved), "hyper_parameters": hyper_parameters})
    assert torch.serialization.get_unsafe_globals_in_checkpoint(saved / "meta.pt")  # torch alone refuses them

    registered = set(torch.serialization.get_safe_globals())  # torch keeps a set: its list's order varies
    verify_sharded_checkpoint(saved)
    loaded = load_trainer_state(saved)["hyper_parameters"]
    assert loaded == hyper_parameters
    assert [type(value) for value in loaded.values()] == [type(value) for value in hyper_parameters.values()]
    assert type(loaded["args"].nested.files[0]) is type(Path("a.txt"))
    assert set(torch.serialization.get_safe_globals()) == registered  # the allow-list is not left registered

    # A type the user registered stays registered after a load that also allowed it.
    with torch.serialization.safe_globals([type(Path("/data"))]):
        load_trainer_state(saved)
        assert type(Path("/data")) in torch.serialization.get_safe_globals()


def test_other_types_are_refused_by_default_naming_them_and_both_fixes(saved, tmp_path):
    state = {**load_trainer_state(saved), "hyper_parameters": {"config": TrainConfig(), "mode": Mode.FAST}}
    save_trainer_state(saved, state)
    message = refused_types(
        saved, "'meta.pt' holds", f"{__name__}.Mode, {__name__}.Span, {__name__}.TrainConfig", "Mode, Span, TrainConfig"
    )
    with expect(message):
        verify_sharded_checkpoint(saved)
    with expect(message):
        load_trainer_state(saved)

    # Either fix loads the same objects: trusting the file, or registering the types with torch.
    assert load_trainer_state(saved, weights_only=False)["hyper_parameters"] == {
        "config": TrainConfig(),
        "mode": Mode.FAST,
    }
    with torch.serialization.safe_globals([TrainConfig, Mode, Span]):
        verify_sharded_checkpoint(saved)
        loaded = load_trainer_state(saved)["hyper_parameters"]
    assert loaded == {"config": TrainConfig(), "mode": Mode.FAST} and type(loaded["config"].span) is Span
    with expect(message):  # registered only inside the block
        load_trainer_state(saved)


def test_a_type_torch_cannot_rebuild_even_when_registered_is_refused_with_the_trust_fix_only(saved):
    save_trainer_state(saved, {**load_trainer_state(saved), "hyper_parameters": {"extra": AttributeDict(depth=2)}})
    with expect(
        refused_types(saved, "'meta.pt' holds", "lightning.fabric.utilities.data.AttributeDict", "AttributeDict")
    ):
        load_trainer_state(saved)
    # The weights-only unpickler of torch 2.13 and 2.14 fills only plain dicts, OrderedDicts and Counters, whatever is
    # registered; torch 2.9 rebuilds a registered dict subclass.
    start = (
        f"Checkpoint '{saved}' is refused: 'meta.pt' holds objects that torch.load(weights_only=True) cannot rebuild ("
    )
    with torch.serialization.safe_globals([AttributeDict]):
        try:
            rebuilt = load_trainer_state(saved)["hyper_parameters"]
        except CheckpointError as refusal:
            assert re.match(f"^{re.escape(start)}.*AttributeDict.*\\). {re.escape(TRUST)}$", str(refusal)), str(refusal)
        else:
            assert rebuilt == {"extra": AttributeDict(depth=2)} and isinstance(rebuilt["extra"], AttributeDict)
    assert load_trainer_state(saved, weights_only=False)["hyper_parameters"] == {"extra": AttributeDict(depth=2)}


def test_a_non_tensor_shard_entry_of_another_type_takes_the_same_fixes(tmp_path, single_rank_group):
    path = tmp_path / "ck"
    dcp.save(
        {"model": {"w": torch.ones(2)}, "optimizer_0": {"param_groups": [{"mode": Mode.FAST}]}}, checkpoint_id=path
    )
    save_trainer_state(path, {"epoch": 0})
    entry = "optimizer_0.param_groups.0.mode"
    with expect(refused_types(path, f"shard file '{SHARD}' holds '{entry}' with", f"{__name__}.Mode", "Mode")):
        verify_sharded_checkpoint(path)
    verify_sharded_checkpoint(path, weights_only=False)
    with torch.serialization.safe_globals([Mode]):
        verify_sharded_checkpoint(path)


def local_function():
    class Local:
        pass

    return Local()


@pytest.mark.parametrize(
    ("state", "where", "kind", "hint"),
    [
        (
            {"hyper_parameters": {"loss_fn": lambda x: x}},
            "checkpoint['hyper_parameters']['loss_fn']",
            "function",
            " Define it at module level, or leave it out of the hyper-parameters:"
            " self.save_hyperparameters(ignore=['loss_fn']).",
        ),
        (
            {"hyper_parameters": {"config": Holder(content={"schedule": [1, local_function()]})}},
            "checkpoint['hyper_parameters']['config'].content['schedule'][1]",
            f"{__name__}.local_function.<locals>.Local",
            " Define it at module level, or leave it out of the hyper-parameters:"
            " self.save_hyperparameters(ignore=['config']).",
        ),
        (
            {"callbacks": {"Tuner{'mode': 'fast'}": {"history": [0, (1, local_function())]}}},
            "checkpoint['callbacks'][\"Tuner{'mode': 'fast'}\"]['history'][1][1]",
            f"{__name__}.local_function.<locals>.Local",
            " Define it at module level, or store it in a form that pickles (e.g. plain data).",
        ),
    ],
    ids=["lambda-hyper-parameter", "local-class-in-a-dataclass", "local-class-in-callback-state"],
)
def test_what_torch_save_cannot_pickle_is_refused_by_key_path_before_anything_is_written(
    tmp_path, state, where, kind, hint
):
    start = f"Cannot save the trainer state of checkpoint '{tmp_path}' to 'meta.pt': {where} is a {kind}, which torch.save cannot pickle ("
    with pytest.raises(TypeError, match=f"^{re.escape(start)}.+\\){re.escape('.' + hint)}$"):
        check_trainer_state(state, checkpoint=tmp_path)
    with pytest.raises(TypeError, match=f"^{re.escape(start)}"):
        save_trainer_state(tmp_path, state)
    assert list(tmp_path.iterdir()) == []


def test_a_dtensor_in_the_trainer_state_is_refused_before_anything_is_written(tmp_path, mesh):
    model = fully_shard(nn.Linear(2, 2), mesh=mesh)
    state = {"callbacks": {"EMA": {"shadow": {"weight": model.weight.detach()}}}}
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"Cannot save the trainer state of checkpoint '{tmp_path}' to 'meta.pt': checkpoint['callbacks']['EMA']"
            "['shadow']['weight'] is a DTensor, and 'meta.pt' is written by rank 0 alone, so it would hold rank 0's"
            " shard only. Save value.full_tensor() instead."
        ),
    ):
        save_trainer_state(tmp_path, state)
    assert list(tmp_path.iterdir()) == []


class ConfiguredLM(TinyLM):
    """The module that wrote tests/data/meta_4b3e3e0.pt (fsdp-strategy at commit 4b3e3e0, before this change)."""

    def __init__(
        self,
        data_dir: Path = Path("/data/tokens"),
        args=argparse.Namespace(seed=3),  # noqa: B008  (as the module that wrote the file had it)
        n_layer: int = 1,
    ) -> None:
        super().__init__(n_layer=n_layer)
        self.save_hyperparameters()


def test_a_trainer_state_written_as_plain_data_by_the_former_version_still_loads_and_resumes(trainer_env, tmp_path):
    def trainer(max_steps: int) -> lightning.Trainer:
        return lightning.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=fsdp_strategy.FSDP2Strategy(state_dict_type="sharded"),
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )

    first = trainer(2)
    first.fit(ConfiguredLM(), token_loader(samples=16))
    first.save_checkpoint(tmp_path / "ck")
    # The former version wrote meta.pt as plain data (paths as str, namespaces as dicts); DCP's part is unchanged.
    shutil.copyfile(Path(__file__).parent / "data" / "meta_4b3e3e0.pt", tmp_path / "ck" / "meta.pt")
    verify_sharded_checkpoint(tmp_path / "ck")
    state = load_trainer_state(tmp_path / "ck")
    assert state["hyper_parameters"] == {"data_dir": "/data/tokens", "args": {"seed": 3}, "n_layer": 1}
    assert state["global_step"] == 2

    trainer_env.fresh()
    resumed = trainer(4)
    resumed.fit(ConfiguredLM(), token_loader(samples=16), ckpt_path=tmp_path / "ck")
    assert resumed.global_step == 4


# --- a checkpoint of another model ----------------------------------------------------------------


def sharded(model: nn.Module, mesh) -> nn.Module:
    fully_shard(model, mesh=mesh)
    return model


@pytest.fixture
def one_block_checkpoint(mesh, tmp_path) -> Path:
    """A sharded checkpoint of TinyLM(n_layer=1), written by the strategy's own checkpoint code."""
    torch.manual_seed(0)
    model = sharded(TinyLM(n_layer=1), mesh)
    path = tmp_path / "ck"
    writing.save_sharded(path, {"state_dict": ckpt.model_state(model, full=False), "epoch": 0}, is_rank_zero=True)
    return path


def test_the_same_architecture_matches(one_block_checkpoint, mesh):
    state_dict = get_model_state_dict(sharded(TinyLM(n_layer=1), mesh))
    assert all(isinstance(value, DTensor) for value in state_dict.values())
    check_model_matches(one_block_checkpoint, state_dict)
    assert saved_shapes(read_dcp_metadata(one_block_checkpoint))["embed.weight"] == (32, 16)


def test_a_wider_model_is_told_its_shape_mismatches(one_block_checkpoint, mesh):
    wider = TinyLM(n_layer=1)
    wider.blocks[0].mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    message = (
        f"Checkpoint '{one_block_checkpoint}' was saved from a different model (as its '.metadata' lists the saved"
        " tensors): 3 shape mismatches (model vs checkpoint): 'blocks.0.mlp.0.weight' (64, 16) vs (32, 16),"
        " 'blocks.0.mlp.0.bias' (64,) vs (32,), 'blocks.0.mlp.2.weight' (16, 64) vs (16, 32)."
    )
    state_dict = get_model_state_dict(sharded(wider, mesh))
    with expect(message):
        check_model_matches(one_block_checkpoint, state_dict)
    with expect(message):  # loading without strict checks still cannot fill tensors of another shape
        check_model_matches(one_block_checkpoint, state_dict, strict=False)


def test_a_renamed_layer_is_told_as_missing_and_unexpected_keys(one_block_checkpoint, mesh):
    renamed = TinyLM(n_layer=1)
    renamed.final_norm = renamed.norm
    del renamed.norm
    state_dict = get_model_state_dict(sharded(renamed, mesh))
    with expect(
        f"Checkpoint '{one_block_checkpoint}' was saved from a different model (as its '.metadata' lists the saved"
        " tensors): 2 missing keys (in the model, not in the checkpoint): 'final_norm.weight', 'final_norm.bias';"
        " 2 unexpected keys (in the checkpoint, not in the model): 'norm.weight', 'norm.bias'."
    ):
        check_model_matches(one_block_checkpoint, state_dict)
    check_model_matches(one_block_checkpoint, state_dict, strict=False)


def test_a_deeper_model_lists_only_the_first_missing_keys(one_block_checkpoint, mesh):
    state_dict = get_model_state_dict(sharded(TinyLM(n_layer=3), mesh))
    with expect(
        f"Checkpoint '{one_block_checkpoint}' was saved from a different model (as its '.metadata' lists the saved"
        " tensors): 18 missing keys (in the model, not in the checkpoint): 'blocks.1.norm.weight',"
        " 'blocks.1.norm.bias', 'blocks.1.attn_q.weight' and 15 more."
    ):
        check_model_matches(one_block_checkpoint, state_dict, limit=3)


def test_compare_keys_on_plain_shapes():
    compare_keys({"a": (2,), "b": None}, {"b": None, "a": (2,)}, checkpoint=Path("/ck"))
    with expect(
        "Checkpoint '/ck' was saved from a different model (as its '.metadata' lists the saved tensors):"
        " 1 missing key (in the model, not in the checkpoint): 'c'; 1 unexpected key (in the checkpoint, not in the"
        " model): 'd'; 2 shape mismatches (model vs checkpoint): 'a' (2,) vs (3,), 'b' not a tensor vs (1,)."
    ):
        compare_keys({"a": (2,), "b": None, "c": (1,)}, {"a": (3,), "b": (1,), "d": ()}, checkpoint=Path("/ck"))


def test_a_file_is_not_a_sharded_checkpoint(tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"")
    assert not is_sharded_checkpoint(tmp_path / "model.ckpt")
    assert not is_sharded_checkpoint(tmp_path) and not is_half_written(tmp_path)
    with expect(
        f"Checkpoint '{tmp_path / 'model.ckpt'}' is not a directory; a sharded checkpoint is a directory with"
        " '.metadata', shard files and 'meta.pt'."
    ):
        verify_sharded_checkpoint(tmp_path / "model.ckpt")
