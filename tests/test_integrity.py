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
from collections import Counter, OrderedDict
from pathlib import Path

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

import fsdp_strategy  # noqa: F401  (registers strategy="fsdp2")
from fsdp_strategy import checkpoint as ckpt
from fsdp_strategy.integrity import (
    CheckpointError,
    check_model_matches,
    compare_keys,
    is_half_written,
    load_trainer_state,
    looks_like_sharded_checkpoint,
    read_dcp_metadata,
    save_trainer_state,
    saved_shapes,
    to_plain_trainer_state,
    verify_sharded_checkpoint,
)
from integration_tests.models import TinyLM, token_loader

SHARD = "__0_0.distcp"


class ScheduledLM(TinyLM):
    """TinyLM with saved hyper-parameters and a StepLR: what a typical Lightning checkpoint carries."""

    def __init__(self, n_layer: int = 2, lr: float = 1e-2, run_name: str = "integrity", betas: tuple = (0.9, 0.99)) -> None:
        super().__init__(n_layer=n_layer, lr=lr)
        self.save_hyperparameters()

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)}


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
    assert looks_like_sharded_checkpoint(saved) and not is_half_written(saved)

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


def test_the_trainer_state_file_name_is_the_one_the_checkpoint_module_writes():
    from fsdp_strategy.integrity import TRAINER_STATE_FILENAME

    assert TRAINER_STATE_FILENAME == ckpt.METADATA_FILENAME


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
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="../elsewhere.distcp")
    (saved / ".metadata").write_bytes(pickle.dumps(metadata))
    with expect(
        f"Checkpoint '{saved}' is damaged: '.metadata' points 'model.scale' to '../elsewhere.distcp', outside the"
        " checkpoint directory."
    ):
        verify_sharded_checkpoint(saved)


def test_a_non_tensor_shard_entry_that_is_not_plain_data_is_refused_without_running_it(tmp_path, single_rank_group):
    path = tmp_path / "ck"
    dcp.save({"model": {"w": torch.ones(2)}, "extra": Payload(tmp_path / "control")}, checkpoint_id=path)
    save_trainer_state(path, {"epoch": 0})
    # DCP's own loader unpickles non-tensor entries unrestricted: the payload is live.
    dcp.load({"model": {"w": torch.zeros(2)}, "extra": None}, checkpoint_id=path)
    assert (tmp_path / "control").exists()

    shutil.rmtree(path)
    dcp.save({"model": {"w": torch.ones(2)}, "extra": Payload(tmp_path / "marker")}, checkpoint_id=path)
    save_trainer_state(path, {"epoch": 0})
    with expect(
        f"Checkpoint '{path}' is refused: shard file '{SHARD}' holds 'extra' with objects that are not plain data"
        " (exec) and will not be unpickled, since unpickling them can run arbitrary code."
    ):
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
    with pytest.raises(CheckpointError, match=re.escape(f"Checkpoint '{saved}' is damaged: '.metadata' is not a Distributed")):
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
    assert looks_like_sharded_checkpoint(saved) and is_half_written(saved)
    assert ckpt.is_sharded_checkpoint(saved)  # to checkpoint.py, meta.pt alone makes it look complete
    with expect(
        f"Checkpoint '{saved}' is damaged: '.metadata' is missing (a save that was interrupted leaves the directory so)."
    ):
        verify_sharded_checkpoint(saved)


# --- meta.pt --------------------------------------------------------------------------------------


def test_a_missing_trainer_state_is_a_half_written_checkpoint(saved):
    (saved / "meta.pt").unlink()
    assert looks_like_sharded_checkpoint(saved) and is_half_written(saved)
    assert not ckpt.is_sharded_checkpoint(saved)  # so the strategy must not take it for a single-file checkpoint
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
    message = (
        f"Checkpoint '{saved}' is refused: 'meta.pt' contains objects that are not plain data (exec) and will"
        " not be unpickled, since unpickling them can run arbitrary code. If the checkpoint comes from a trusted"
        " source, convert it once: fsdp_strategy.integrity.save_trainer_state(path, load_trainer_state(path, trusted=True))."
    )
    with expect(message):
        verify_sharded_checkpoint(saved)
    with expect(message):
        load_trainer_state(saved)
    assert not (tmp_path / "marker").exists()


def test_an_older_trainer_state_with_a_path_is_refused_and_can_be_converted_once(tmp_path):
    data_dir = Path("/data/tokens")
    torch.save({"epoch": 1, "hyper_parameters": {"data_dir": data_dir}}, tmp_path / "meta.pt")  # the former writer
    path_class = f"{type(data_dir).__module__}.{type(data_dir).__qualname__}"
    with pytest.raises(CheckpointError, match=re.escape(f"'meta.pt' contains objects that are not plain data ({path_class})")):
        load_trainer_state(tmp_path)

    save_trainer_state(tmp_path, load_trainer_state(tmp_path, trusted=True))
    assert load_trainer_state(tmp_path) == {"epoch": 1, "hyper_parameters": {"data_dir": "/data/tokens"}}


# --- writing plain trainer state ------------------------------------------------------------------


class Mode(enum.Enum):
    FAST = "fast"


def test_lightning_objects_are_saved_as_plain_data_of_the_same_value(saved):
    np = pytest.importorskip("numpy")
    state = torch.load(saved / "meta.pt", weights_only=False)  # a real Lightning trainer state
    state["hyper_parameters"] = AttributeDict(
        data_dir=Path("/data"),
        args=argparse.Namespace(seed=3, nested=argparse.Namespace(files=[Path("a.txt")])),
        order=OrderedDict(b=1, a=2),
        counts=Counter(x=2),
        tags={"a", "b"},
        shape=torch.Size([2, 3]),
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        scale=np.float32(0.5),
        steps=np.int64(7),
        table={1: "one", (2, 3): None},
        weights=torch.arange(3.0),
    )
    save_trainer_state(saved, state)
    loaded = load_trainer_state(saved)

    assert type(loaded["hyper_parameters"]) is dict
    expected = {**state, "hyper_parameters": {
        "data_dir": "/data",
        "args": {"seed": 3, "nested": {"files": ["a.txt"]}},
        "order": OrderedDict(b=1, a=2),
        "counts": Counter(x=2),
        "tags": {"a", "b"},
        "shape": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "dtype": torch.bfloat16,
        "scale": 0.5,
        "steps": 7,
        "table": {1: "one", (2, 3): None},
        "weights": torch.arange(3.0),
    }}
    assert_same(loaded, expected)


def test_the_conversion_alone_leaves_its_input_untouched():
    hyper_parameters = AttributeDict(data_dir=Path("/data"), args=argparse.Namespace(seed=3))
    state = {"epoch": 1, "hyper_parameters": hyper_parameters}
    plain = to_plain_trainer_state(state, checkpoint=Path("/ck"))
    assert plain == {"epoch": 1, "hyper_parameters": {"data_dir": "/data", "args": {"seed": 3}}}
    assert state["hyper_parameters"] is hyper_parameters and hyper_parameters.data_dir == Path("/data")


@pytest.mark.parametrize(
    ("state", "detail"),
    [
        (
            {"hyper_parameters": {"loss_fn": nn.MSELoss()}},
            "checkpoint['hyper_parameters']['loss_fn'] is a torch.nn.modules.loss.MSELoss, and 'meta.pt' only holds"
            " plain data (dicts, lists, tuples, sets, str, int, float, bool, None and tensors) so that it can be loaded"
            " without running code stored in it. Leave it out of the hyper-parameters:"
            " self.save_hyperparameters(ignore=['loss_fn']).",
        ),
        (
            {"callbacks": {"Tuner{'mode': 'fast'}": {"mode": Mode.FAST}}},
            f"checkpoint['callbacks'][\"Tuner{{'mode': 'fast'}}\"]['mode'] is a {__name__}.Mode, and 'meta.pt' only"
            " holds plain data (dicts, lists, tuples, sets, str, int, float, bool, None and tensors) so that it can be"
            " loaded without running code stored in it. Store its value ('fast') instead.",
        ),
        (
            {"loops": [0, (1, print)]},
            "checkpoint['loops'][1][1] is a builtin_function_or_method, and 'meta.pt' only holds plain data (dicts,"
            " lists, tuples, sets, str, int, float, bool, None and tensors) so that it can be loaded without running"
            " code stored in it. Store it as plain data instead (in the callback's state_dict or the module's"
            " on_save_checkpoint).",
        ),
    ],
    ids=["module-hyper-parameter", "enum-in-callback-state", "function-in-a-list"],
)
def test_objects_that_are_not_plain_data_are_refused_by_key_path_before_anything_is_written(tmp_path, state, detail):
    message = f"Cannot save the trainer state of checkpoint '{tmp_path}' to 'meta.pt': {detail}"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        save_trainer_state(tmp_path, state)
    assert list(tmp_path.iterdir()) == []


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
    ckpt.save_sharded(path, {"state_dict": ckpt.model_state(model, full=False), "epoch": 0}, is_rank_zero=True)
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
    assert not looks_like_sharded_checkpoint(tmp_path / "model.ckpt")
    assert not looks_like_sharded_checkpoint(tmp_path) and not is_half_written(tmp_path)
    with expect(
        f"Checkpoint '{tmp_path / 'model.ckpt'}' is not a directory; a sharded checkpoint is a directory with"
        " '.metadata', shard files and 'meta.pt'."
    ):
        verify_sharded_checkpoint(tmp_path / "model.ckpt")
