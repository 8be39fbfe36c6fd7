"""``consolidate_checkpoint`` and ``fsdp-strategy consolidate``: a sharded checkpoint directory to one Lightning file.

Checkpoints are saved for real (on a 1-rank gloo group and by an in-process Trainer); consolidation and loading
then run with no process group at all. A checkpoint saved by two processes, and the ``python -m fsdp_strategy``
command, are in integration_tests/test_consolidate_processes.py.
"""

from __future__ import annotations

import enum
import gc
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_strategy import CheckpointError, FSDP2Strategy
from fsdp_strategy.checkpoint import state_dicts as ckpt
from fsdp_strategy.checkpoint import writing
from fsdp_strategy.tools import consolidate as consolidate_module
from fsdp_strategy.tools.cli import main
from fsdp_strategy.tools.consolidate import consolidate_checkpoint
from testkit import full
from testkit.checkpoints import assert_same
from testkit.models import TinyLM, token_loader

# dcp.save(no_dist=True) writes the small hand-made checkpoints below; it warns that it runs without a group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's own index-keyed ``Optimizer.state_dict()``, with each DTensor gathered to a plain tensor."""
    state = optimizer.state_dict()
    return {
        "state": {i: {key: full(value).clone() for key, value in s.items()} for i, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }


@dataclass
class Saved:
    path: Path
    params: dict[str, torch.Tensor]  # the LightningModule's state_dict() keys, full tensors
    optimizers: list[dict[str, Any]]  # index keyed, full tensors
    tensors: int  # entries stored as tensors in the DCP data


def save_sharded_tinylm(mesh, path: Path) -> Saved:
    """A sharded TinyLM with two optimizers: AdamW over two param groups in an order of their own (stepped
    twice) and SGD with momentum (never stepped, so it has no per-parameter state)."""
    torch.manual_seed(0)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    no_decay = [p for name, p in model.named_parameters() if name.endswith("bias") or "norm" in name]
    decay = [p for name, p in model.named_parameters() if not (name.endswith("bias") or "norm" in name)]
    adamw = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "lr": 3e-3}], lr=1e-2)
    sgd = torch.optim.SGD(model.blocks[0].parameters(), lr=0.1, momentum=0.9)
    for batch in list(token_loader(batch_size=4, samples=8)):
        adamw.zero_grad()
        model.loss(batch).backward()
        adamw.step()
    saved = Saved(
        path,
        params={name: full(value).clone() for name, value in model.state_dict().items()},
        optimizers=[full_optimizer_state(adamw), full_optimizer_state(sgd)],
        tensors=0,
    )
    checkpoint = {
        "state_dict": ckpt.model_state(model, full=False),
        "optimizer_states": [ckpt.optimizer_state(model, opt, full=False) for opt in (adamw, sgd)],
        "global_step": 2,
        "epoch": 0,
        "hyper_parameters": {"lr": 1e-2, "n_layer": 3, "optimizer": "adamw"},
        "pytorch-lightning_version": L.__version__,
    }
    writing.save_sharded(path, checkpoint, is_rank_zero=True)
    saved.tensors = sum(
        1 for md in FileSystemReader(path).read_metadata().state_dict_metadata.values() if hasattr(md, "size")
    )
    return saved


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    """One sharded checkpoint for the module's tests (which only read it), saved on a real 1-rank gloo group
    that is destroyed before any test runs: consolidation and loading happen with no process group."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True)  # port 0: the OS picks a free one
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return save_sharded_tinylm(init_device_mesh("cpu", (1,)), tmp_path_factory.mktemp("saved") / "sharded")
    finally:
        dist.destroy_process_group()


def test_consolidated_file_has_full_tensors_index_keyed_optimizers_and_trainer_state(saved, tmp_path):
    out = consolidate_checkpoint(saved.path, tmp_path / "out.ckpt", progress=False)
    assert out == tmp_path / "out.ckpt"
    assert not dist.is_initialized()

    checkpoint = torch.load(out, weights_only=True)  # plain data only
    assert_same(checkpoint["state_dict"], saved.params)
    assert len(checkpoint["optimizer_states"]) == 2
    assert_same(checkpoint["optimizer_states"][0], saved.optimizers[0])
    assert_same(checkpoint["optimizer_states"][1], saved.optimizers[1])
    adamw_groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert [g["weight_decay"] for g in adamw_groups] == [0.0, 0.01] and [g["lr"] for g in adamw_groups] == [1e-2, 3e-3]
    assert adamw_groups[0]["betas"] == (0.9, 0.999)
    assert checkpoint["optimizer_states"][1]["state"] == {}  # SGD never stepped
    assert checkpoint["global_step"] == 2 and checkpoint["epoch"] == 0
    assert checkpoint["hyper_parameters"] == {"lr": 1e-2, "n_layer": 3, "optimizer": "adamw"}
    assert checkpoint["pytorch-lightning_version"] == L.__version__

    # A plain torch optimizer over an unsharded model takes the states as they are.
    model = TinyLM()
    model.load_state_dict(checkpoint["state_dict"])
    no_decay = [p for name, p in model.named_parameters() if name.endswith("bias") or "norm" in name]
    decay = [p for name, p in model.named_parameters() if not (name.endswith("bias") or "norm" in name)]
    adamw = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "lr": 3e-3}], lr=1e-2)
    adamw.load_state_dict(checkpoint["optimizer_states"][0])
    assert_same(adamw.state_dict(), saved.optimizers[0])


def test_load_from_checkpoint_without_process_group_gives_the_saved_parameters(saved, tmp_path):
    out = consolidate_checkpoint(saved.path, tmp_path / "out.ckpt", progress=False)
    model = TinyLM.load_from_checkpoint(out)
    assert not dist.is_initialized()
    assert_same({k: v.detach() for k, v in model.state_dict().items()}, saved.params)


def test_reads_one_tensor_at_a_time(saved, tmp_path, monkeypatch):
    reads: list[tuple[set[str], set[LoadItemType]]] = []
    original = FileSystemReader.read_data

    def recording(self, plan, planner):
        reads.append(({item.storage_index.fqn for item in plan.items}, {item.type for item in plan.items}))
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", recording)
    consolidate_checkpoint(saved.path, tmp_path / "out.ckpt", progress=False)

    tensor_reads = [keys for keys, types in reads if LoadItemType.BYTE_IO not in types]
    byte_reads = [keys for keys, types in reads if LoadItemType.BYTE_IO in types]
    assert len(tensor_reads) == saved.tensors
    assert all(len(keys) == 1 for keys in tensor_reads)
    assert len(set().union(*tensor_reads)) == saved.tensors  # each tensor read once
    assert len(byte_reads) == 1 and all(key.startswith("optimizer_") for key in byte_reads[0])


def _peak_rss_growth_bytes(run) -> int:
    """Peak resident memory during ``run()`` above the resident memory before it (Linux)."""

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = status("VmRSS")
    run()
    return status("VmHWM") - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
def test_peak_memory_stays_near_one_copy_of_the_state(tmp_path):
    # Tensors of 34 MiB are above glibc's largest mmap threshold (32 MiB): each allocation is fresh
    # memory, freed memory goes back to the system, and the peak counts every copy held at once.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here")
    state = {f"layer{i}.weight": torch.full((34 * 2**18,), float(i)) for i in range(4)}
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    dcp.save({"model": state}, checkpoint_id=tmp_path / "big", no_dist=True)
    torch.save({"global_step": 1}, tmp_path / "big" / "meta.pt")
    del state
    gc.collect()

    out = tmp_path / "big.ckpt"
    growth = _peak_rss_growth_bytes(lambda: consolidate_checkpoint(tmp_path / "big", out, progress=False))
    assert growth < 1.5 * state_bytes, f"peak grew by {growth / state_bytes:.2f}x the state"
    consolidated = torch.load(out, weights_only=True)["state_dict"]
    assert torch.equal(consolidated["layer3.weight"], torch.full((34 * 2**18,), 3.0))


# --- a real Trainer, a checkpoint written by two ranks ------------------------------------------------------


class RecordStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.global_step = trainer.global_step
        self.params = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}
        self.optimizer = full_optimizer_state(trainer.optimizers[0])  # a copy: the optimizer steps on


def test_trainer_checkpoint_consolidates_and_resumes_on_a_single_device(trainer_env, tmp_path):
    flags: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    torch.manual_seed(0)
    model = TinyLM()
    first = L.Trainer(strategy=FSDP2Strategy(state_dict_type="sharded"), max_steps=2, **flags)
    first.fit(model, token_loader(batch_size=4, samples=16))
    first.save_checkpoint(tmp_path / "sharded")
    params = {name: full(value).clone() for name, value in model.state_dict().items()}
    optimizer = full_optimizer_state(first.optimizers[0])
    trainer_env.fresh()  # the Trainer's process group is gone
    assert not dist.is_initialized()

    out = consolidate_checkpoint(tmp_path / "sharded", tmp_path / "last.ckpt", progress=False)
    checkpoint = torch.load(out, weights_only=True)
    assert_same(checkpoint["state_dict"], params)
    assert_same(checkpoint["optimizer_states"], [optimizer])
    meta = torch.load(tmp_path / "sharded" / "meta.pt", weights_only=False)
    assert meta.keys() <= checkpoint.keys()
    for key in meta:
        assert_same(checkpoint[key], meta[key], key)
    assert checkpoint["global_step"] == 2

    start = RecordStart()
    second = L.Trainer(strategy="auto", max_steps=3, callbacks=[start], **flags)
    resumed = TinyLM()
    second.fit(resumed, token_loader(batch_size=4, samples=16), ckpt_path=out)
    assert start.global_step == 2
    assert_same(start.params, params)
    assert_same(start.optimizer, optimizer)
    assert second.global_step == 3


# --- the command -----------------------------------------------------------------------------------------


def test_command_writes_the_file_and_reports_it(saved, tmp_path, capsys):
    out = tmp_path / "nested" / "out.ckpt"
    assert main(["consolidate", str(saved.path), str(out), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert_same(torch.load(out, weights_only=False)["state_dict"], saved.params)
    lines = captured.out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{out}: {saved.tensors} tensors, ")
    assert lines[0].endswith(f"file {out.stat().st_size / 1024:.1f} KiB")
    assert captured.err == ""


def test_command_shows_progress_on_stderr_by_default(saved, tmp_path, capsys):
    pytest.importorskip("tqdm")
    assert main(["consolidate", str(saved.path), str(tmp_path / "out.ckpt")]) == 0
    err = capsys.readouterr().err
    assert "Consolidating" in err and f"{saved.tensors}/{saved.tensors}" in err


# --- bad inputs ------------------------------------------------------------------------------------------


def dcp_dir_with_meta(path: Path) -> Path:
    dcp.save({"model": {"w": torch.arange(4.0)}}, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 0}, path / "meta.pt")
    return path


def error_of(capsys, *argv: str) -> str:
    assert main(["consolidate", *argv, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith("\n") and captured.err.count("\n") == 1  # one line, no traceback
    return captured.err.rstrip("\n")


def test_missing_directory(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as info:
        consolidate_checkpoint(missing, tmp_path / "out.ckpt")
    assert str(info.value) == f"checkpoint directory {missing} does not exist"
    assert error_of(capsys, str(missing), str(tmp_path / "out.ckpt")) == (
        f"fsdp-strategy consolidate: error: checkpoint directory {missing} does not exist"
    )


def test_a_file_instead_of_a_directory(tmp_path, capsys):
    single = tmp_path / "single.ckpt"
    torch.save({"state_dict": {}}, single)
    with pytest.raises(ValueError) as info:
        consolidate_checkpoint(single, tmp_path / "out.ckpt")
    assert str(info.value) == (
        f"{single} is not a directory; expected a sharded checkpoint directory (with .metadata and meta.pt)"
    )


def test_directory_without_dcp_metadata(tmp_path, capsys):
    folder = tmp_path / "ck"
    folder.mkdir()
    torch.save({"global_step": 0}, folder / "meta.pt")
    message = f"{folder} is not a sharded checkpoint: it has no .metadata file (the Distributed Checkpoint index)"
    with pytest.raises(ValueError) as info:
        consolidate_checkpoint(folder, tmp_path / "out.ckpt")
    assert str(info.value) == message
    assert error_of(capsys, str(folder), str(tmp_path / "out.ckpt")) == f"fsdp-strategy consolidate: error: {message}"
    assert not (tmp_path / "out.ckpt").exists()


def test_directory_without_meta_pt(tmp_path):
    folder = dcp_dir_with_meta(tmp_path / "ck")
    (folder / "meta.pt").unlink()
    with pytest.raises(ValueError) as info:
        consolidate_checkpoint(folder, tmp_path / "out.ckpt")
    assert str(info.value) == (
        f"{folder} is not a sharded Lightning checkpoint: it has no meta.pt file (the trainer state)"
    )


# Deeper damage is found by fsdp_strategy.checkpoint.verify (tested in test_integrity.py, which owns the wording):
# here only that consolidation stops with its CheckpointError, a ValueError naming directory and file.


def test_missing_shard_file(tmp_path, capsys):
    folder = dcp_dir_with_meta(tmp_path / "ck")
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError) as info:
        consolidate_checkpoint(folder, tmp_path / "out.ckpt")
    assert isinstance(info.value, ValueError)
    assert (info.value.checkpoint, info.value.file) == (folder, "__0_0.distcp")
    assert str(folder) in str(info.value) and "'__0_0.distcp' is missing" in str(info.value)
    assert (
        error_of(capsys, str(folder), str(tmp_path / "out.ckpt")) == f"fsdp-strategy consolidate: error: {info.value}"
    )


def test_damaged_index(tmp_path):
    folder = dcp_dir_with_meta(tmp_path / "ck")
    (folder / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError) as info:
        consolidate_checkpoint(folder, tmp_path / "out.ckpt")
    assert (info.value.checkpoint, info.value.file) == (folder, ".metadata")


class NotPlainData:
    """Unpickling it would run code of this module: a stand-in for a malicious object."""

    unpickled = 0

    def __reduce__(self):
        return (NotPlainData._rebuild, ())

    @staticmethod
    def _rebuild():
        NotPlainData.unpickled += 1
        return NotPlainData()


def test_non_tensor_entries_that_are_not_plain_data_are_never_unpickled(tmp_path):
    folder = tmp_path / "ck"
    optimizer = {"state": {}, "param_groups": [{"lr": 0.1, "hook": NotPlainData(), "params": ["w"]}]}
    dcp.save({"model": {"w": torch.arange(4.0)}, "optimizer_0": optimizer}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 0}, folder / "meta.pt")
    with pytest.raises(CheckpointError) as info:
        consolidate_checkpoint(folder, tmp_path / "out.ckpt")
    assert "is refused" in str(info.value) and "optimizer_0.param_groups.0.hook" in str(info.value)
    assert NotPlainData.unpickled == 0
    assert not (tmp_path / "out.ckpt").exists()

    # Trusted, they are read as DCP itself reads them.
    consolidate_checkpoint(folder, tmp_path / "out.ckpt", weights_only=False, progress=False)
    assert NotPlainData.unpickled > 0


class Mode(enum.Enum):
    FAST = "fast"


@dataclass
class TrainConfig:
    mode: Mode = Mode.FAST
    data_dir: Path = Path("/data")


def test_hyper_parameters_of_your_own_types_take_the_same_trust_as_in_a_ddp_file(tmp_path, capsys):
    folder = dcp_dir_with_meta(tmp_path / "ck")
    hyper_parameters = {"config": TrainConfig(), "mode": Mode.FAST, "data_dir": Path("/data")}
    torch.save({"global_step": 0, "hyper_parameters": hyper_parameters}, folder / "meta.pt")
    out = tmp_path / "out.ckpt"

    with pytest.raises(CheckpointError) as info:
        consolidate_checkpoint(folder, out, progress=False)
    assert str(info.value).startswith(
        f"Checkpoint '{folder}' is refused: 'meta.pt' holds objects of types that are only loaded from a trusted file:"
        f" {__name__}.Mode, {__name__}.TrainConfig ("
    )
    assert "weights_only=False" in str(info.value) and "add_safe_globals([Mode, TrainConfig])" in str(info.value)
    assert error_of(capsys, str(folder), str(out)) == f"fsdp-strategy consolidate: error: {info.value}"
    assert not out.exists()

    # Trusted: the file holds the objects themselves, and loads as DDP's file does (weights_only=False, or
    # the types registered with torch).
    assert main(["consolidate", str(folder), str(out), "--no-weights-only", "--no-progress"]) == 0
    loaded = torch.load(out, weights_only=False)["hyper_parameters"]
    assert loaded == hyper_parameters and [type(v) for v in loaded.values()] == [
        type(v) for v in hyper_parameters.values()
    ]
    with pytest.raises(pickle.UnpicklingError):
        torch.load(out, weights_only=True)
    with torch.serialization.safe_globals([TrainConfig, Mode, type(Path("/data"))]):
        assert torch.load(out, weights_only=True)["hyper_parameters"] == hyper_parameters
        # Registered types need no trust for consolidation either.
        consolidate_checkpoint(folder, out, overwrite=True, progress=False)


def test_existing_output_is_kept_unless_overwrite(tmp_path, capsys):
    folder = dcp_dir_with_meta(tmp_path / "ck")
    out = tmp_path / "out.ckpt"
    out.write_bytes(b"precious")
    message = f"{out} already exists; pass overwrite=True (--overwrite) to replace it"
    with pytest.raises(FileExistsError) as info:
        consolidate_checkpoint(folder, out)
    assert str(info.value) == message
    assert error_of(capsys, str(folder), str(out)) == f"fsdp-strategy consolidate: error: {message}"
    assert out.read_bytes() == b"precious"

    assert main(["consolidate", str(folder), str(out), "--overwrite", "--no-progress"]) == 0
    assert torch.equal(torch.load(out, weights_only=True)["state_dict"]["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out.ckpt"]


def test_output_that_is_a_directory(tmp_path):
    folder = dcp_dir_with_meta(tmp_path / "ck")
    with pytest.raises(IsADirectoryError) as info:
        consolidate_checkpoint(folder, tmp_path, overwrite=True)
    assert str(info.value) == f"{tmp_path} is a directory; give the path of the checkpoint file to write"


def test_a_failure_while_writing_leaves_no_partial_file(tmp_path, monkeypatch):
    folder = dcp_dir_with_meta(tmp_path / "ck")
    out = tmp_path / "out.ckpt"
    out.write_bytes(b"previous")

    def failing_save(obj, file):
        file.write(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(consolidate_module.torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left on device"):
        consolidate_checkpoint(folder, out, overwrite=True)
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out.ckpt"]
