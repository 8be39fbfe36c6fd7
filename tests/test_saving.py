"""How a save ends (fsdp_strategy.checkpoint.saving) on a real 1-rank group: failures named and cleaned up, stale
staging removed, background saves that copy what training changes, and CheckpointIO plugins."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_strategy import FSDP2Strategy
from fsdp_strategy.checkpoint import background, saving, writing
from fsdp_strategy.checkpoint import state_dicts as ckpt
from fsdp_strategy.checkpoint.saving import CheckpointSaveError
from fsdp_strategy.checkpoint.staging import remove_stale_staging, staging_token
from testkit import full
from testkit.callbacks import RecordingIO
from testkit.faults import Disk
from testkit.models import TinyLM, token_loader
from tests.test_checkpoint import adamw, sharded_tinylm, train_step

# --- naming the failure ----------------------------------------------------------------------------


def test_a_full_disk_that_torch_save_hides_behind_unexpected_pos_is_named(tmp_path):
    disk = Disk(tmp_path, room=600).install()
    disk.arm()
    try:
        with pytest.raises(RuntimeError, match="unexpected pos") as hidden, open(tmp_path / "f", "wb") as file:
            torch.save({"w": torch.zeros(1000), "b": torch.zeros(1000)}, file)
    finally:
        disk.uninstall()
    assert isinstance(hidden.value.__context__, OSError)
    message, code = saving.describe_failure(hidden.value, checkpoint=tmp_path / "last.ckpt", rank=3)
    assert message == f"no space left on device in '{tmp_path}' (rank 3 was writing)"
    assert code == errno.ENOSPC


def test_another_os_error_is_named_with_its_errno(tmp_path):
    error = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".partial-x"))
    message, code = saving.describe_failure(error, checkpoint=tmp_path / "a.ckpt", rank=0)
    assert message == f"[Errno 13] Permission denied: '{tmp_path / '.partial-x'}' (rank 0)"
    assert code == errno.EACCES


def test_the_shard_writer_keeps_the_errno_that_dcp_would_lose_on_its_way_to_every_rank(mesh, tmp_path):
    model = sharded_tinylm(mesh, seed=0)
    state = {"model": ckpt.model_state(model, full=False)}
    disk = Disk(tmp_path, room=500).install()  # fails inside torch.save of a tensor into DCP's file
    disk.arm()
    try:
        with pytest.raises(CheckpointException) as plain:
            dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "plain"))
        with pytest.raises(CheckpointException) as ours:
            dcp.save(state, storage_writer=writing.ShardWriter(tmp_path / "ours"))
    finally:
        disk.uninstall()
    # DCP hands every rank a pickled copy of the failing rank's error, without its __context__.
    hidden = plain.value.failures[0][0]
    assert isinstance(hidden, RuntimeError) and "unexpected pos" in str(hidden) and writing.os_error_in(hidden) is None
    assert writing.os_error_in(ours.value.failures[0][0]).errno == errno.ENOSPC
    message, code = saving.describe_failure(ours.value, checkpoint=tmp_path / "step=4.ckpt", rank=1)
    assert message == f"no space left on device in '{tmp_path}' (rank 0 was writing)" and code == errno.ENOSPC


def test_settle_raises_on_failure_names_the_checkpoint_and_removes_the_staging(single_rank_group, tmp_path):
    staging = tmp_path / ".partial-abc"
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"half")
    cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(CheckpointSaveError) as raised:
        saving.settle(cause, checkpoint=tmp_path / "last.ckpt", staging=staging, rank=0)
    assert str(raised.value) == (
        f"Could not save checkpoint '{tmp_path / 'last.ckpt'}': no space left on device in '{tmp_path}' (rank 0 was"
        " writing). The earlier checkpoints are intact; the partial files of this attempt were removed."
    )
    assert isinstance(raised.value, OSError) and raised.value.errno == errno.ENOSPC
    assert raised.value.__cause__ is cause and not staging.exists()
    saving.settle(None, checkpoint=tmp_path / "last.ckpt", staging=staging, rank=0)  # success: nothing raised


def test_settle_reraises_a_checkpoint_io_plugins_own_error_as_ddp_does(single_rank_group, tmp_path):
    error = TypeError("storage_options not supported")
    with pytest.raises(TypeError) as raised:
        saving.settle(error, checkpoint=tmp_path / "a.ckpt", staging=None, rank=0, plugin="MyIO")
    assert raised.value is error


def test_a_full_file_that_fails_to_write_leaves_no_staging_and_the_older_file_intact(tmp_path):
    path = tmp_path / "new" / "dir" / "last.ckpt"
    writing.save_full_file(path, {"state_dict": {"w": torch.ones(3)}}, "t1")  # creates the directory, as Lightning does
    disk = Disk(path.parent, room=100).install()
    disk.arm()
    try:
        with pytest.raises(RuntimeError, match="unexpected pos"):
            writing.save_full_file(path, {"state_dict": {"w": torch.zeros(1000)}}, "t2")
    finally:
        disk.uninstall()
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    assert torch.equal(torch.load(path)["state_dict"]["w"], torch.ones(3))


def _mount_tmpfs(directory: Path, size: str) -> None:
    directory.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode}); needs root or CAP_SYS_ADMIN"
        )


def test_a_full_disk_is_recognized_by_its_free_space_when_the_os_error_is_lost(tmp_path):
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "1m")
    try:
        with open(disk / "filler", "wb") as file, pytest.raises(OSError):
            file.write(b"\0" * (2 << 20))
        error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        message, code = saving.describe_failure(error, checkpoint=disk / "last.ckpt", rank=0)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert message == (
        f"no space left on device in '{disk}' (rank 0 was writing; 0 B free there; torch reported RuntimeError:"
        " [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598)"
    )
    assert code == errno.ENOSPC


# --- staging left by crashed runs ---------------------------------------------------------------


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _staging(directory: Path, token: str, *, age: float = 3600) -> Path:
    entry = directory / f"{writing.PARTIAL_PREFIX}{token}"
    entry.mkdir()
    (entry / "__0_0.distcp").write_bytes(b"shard")
    past = time.time() - age
    for path in (entry / "__0_0.distcp", entry):
        os.utime(path, (past, past))
    return entry


def test_staging_of_a_crashed_writer_is_removed_and_live_or_unknown_writers_are_kept(tmp_path):
    host = staging_token().split("-")[0]
    crashed = _staging(tmp_path, f"{host}-{_dead_pid()}-aaaa")
    alive = _staging(tmp_path, f"{host}-{os.getpid()}-bbbb")
    elsewhere = _staging(tmp_path, f"0badc0de-{_dead_pid()}-cccc")
    legacy = _staging(tmp_path, "0123456789abcdef")
    just_written = _staging(tmp_path, f"{host}-{_dead_pid()}-dddd", age=-60)  # changed after this process started
    (tmp_path / "last.ckpt").mkdir()

    with pytest.warns(UserWarning) as warned:
        removed = remove_stale_staging(tmp_path)

    assert removed == [crashed] and not crashed.exists()
    assert alive.exists() and elsewhere.exists() and legacy.exists() and just_written.exists()
    assert len(warned) == 1
    assert str(warned[0].message) == (
        f"'{tmp_path}' holds staging entries of checkpoint saves that did not finish: '{legacy.name}', '{elsewhere.name}'."
        " They were written on another machine or by an older version, so they are kept in case their job is still"
        " saving; delete them once no job writes into this directory."
    )


def test_a_staging_token_names_its_writer_and_never_holds_last():
    host, pid, ident = staging_token().split("-")
    assert int(pid) == os.getpid() and re.fullmatch(r"[0-9a-f]{8}", host) and re.fullmatch(r"[0-9a-f]{12}", ident)


# --- background saves --------------------------------------------------------------------------


def test_a_removal_asked_after_the_background_save_finished_happens_at_once(tmp_path):
    old = tmp_path / "old.ckpt"
    old.write_bytes(b"x")
    saves = background.BackgroundSave()
    done: Future = Future()
    saves.submit(done, checkpoint=tmp_path / "new.ckpt", staging=None)
    done.set_result(None)  # the write finished before ModelCheckpoint asked to remove what it replaces
    saves.defer_removal(old, lambda p: Path(p).unlink())
    assert not old.exists()
    assert saves.wait().error is None and not saves.pending


def test_a_removal_waits_for_the_replacement_and_is_dropped_if_that_fails(tmp_path):
    events: list[str] = []
    saves = background.BackgroundSave()
    for outcome in ("ok", "fails"):
        future: Future = Future()
        saves.submit(future, checkpoint=tmp_path / "new.ckpt", staging=None, then=lambda: events.append("published"))
        saves.defer_removal(f"old-{outcome}", lambda p: events.append(f"removed {p}"))
        assert events == ([] if outcome == "ok" else ["published", "removed old-ok"])
        if outcome == "ok":
            future.set_result(None)
            assert saves.wait().error is None
        else:
            future.set_exception(OSError(errno.ENOSPC, "full"))
            assert saves.wait().error.errno == errno.ENOSPC
    assert events == ["published", "removed old-ok"]


def test_a_second_submit_before_wait_is_refused(tmp_path):
    saves = background.BackgroundSave()
    saves.submit(None, checkpoint=tmp_path / "a", staging=None)
    with pytest.raises(RuntimeError, match=re.escape("A background save is still pending")):
        saves.submit(None, checkpoint=tmp_path / "b", staging=None)
    saves.close()
    assert not saves.pending


def test_a_snapshot_copies_the_tensors_training_changes_in_place(mesh):
    model = sharded_tinylm(mesh, seed=0)
    optimizer = adamw(model)
    train_step(model, optimizer)
    live = background.live_storages(model, [optimizer])
    fresh = torch.zeros(3)
    checkpoint = {
        "state_dict": {**ckpt.model_state(model, full=True), "fresh": fresh},
        "optimizer_states": [ckpt.optimizer_state(model, optimizer, full=True)],
        "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(1.0)}},
    }
    # On one rank a "full" optimizer state (and, from torch 2.13 on, a full model entry) is the live tensor itself.
    entries = [
        *checkpoint["state_dict"].values(),
        *(v for s in checkpoint["optimizer_states"][0]["state"].values() for v in s.values()),
    ]
    assert sum(background._storage(t) in live for t in entries if torch.is_tensor(t)) >= len(
        checkpoint["optimizer_states"][0]["state"]
    )

    frozen = background.snapshot(checkpoint, live)
    train_step(model, optimizer, batch_idx=1)

    tensors = [
        *frozen["state_dict"].values(),
        *(v for s in frozen["optimizer_states"][0]["state"].values() for v in s.values()),
    ]
    assert not any(background._storage(t) in live for t in tensors)
    assert frozen["state_dict"]["fresh"] is fresh  # not live: no copy
    assert (
        frozen["callbacks"]["ModelCheckpoint"]["best_model_score"]
        is not checkpoint["callbacks"]["ModelCheckpoint"]["best_model_score"]
    )
    assert not torch.equal(frozen["state_dict"]["blocks.0.attn_q.weight"], full(model.blocks[0].attn_q.weight))
    assert all(state["step"].item() == 1 for state in frozen["optimizer_states"][0]["state"].values())


class RunConfig:
    """A hyper-parameter object: kept as the object in ``meta.pt``, and changeable while a save runs."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_a_background_sharded_save_writes_the_trainer_state_of_its_step(mesh, tmp_path, monkeypatch):
    model = sharded_tinylm(mesh, seed=0)
    shards_written: Future = Future()

    def async_save(state, *, storage_writer, process_group):  # the shards are written; the future completes later
        dcp.save(state, storage_writer=storage_writer, process_group=process_group)
        return shards_written

    monkeypatch.setattr(saving.dcp, "async_save", async_save)
    config, score, history = RunConfig(lr=0.1), torch.tensor(1.0), [1]
    checkpoint = {
        "state_dict": ckpt.model_state(model, full=False),
        "epoch": 0,
        "hyper_parameters": {"config": config},
        "callbacks": {"Tracker": {"score": score, "history": history}},
    }
    saves, path = background.BackgroundSave(), tmp_path / "last.ckpt"
    saving.save_sharded(checkpoint, path, staging_token(), rank=0, background=saves, group=lambda: None)
    # Training goes on while the shards are written: it changes tensors, containers and objects in place.
    score.add_(1)
    history.append(2)
    config.lr = 0.2
    shards_written.set_result(None)  # rank 0 then writes meta.pt and renames the checkpoint into place
    outcome = saves.wait()
    saves.close()

    assert outcome is not None and outcome.error is None
    state = torch.load(path / "meta.pt", weights_only=False)
    assert state["callbacks"]["Tracker"]["score"].item() == 1.0
    assert state["callbacks"]["Tracker"]["history"] == [1]
    assert state["hyper_parameters"]["config"].lr == 0.1


# --- through the Trainer -------------------------------------------------------------------------


def trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **kwargs,
    )


class AtSteps(L.Callback):
    def __init__(self, actions: dict) -> None:
        self.actions = actions

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step in self.actions:
            self.actions[trainer.global_step](pl_module)


def test_an_async_full_save_holds_its_steps_state_while_training_goes_on(trainer_env, tmp_path):
    # One rank: every "full" tensor is the live parameter or optimizer state. The disk holds the write of
    # the step-2 checkpoint until step 3 has changed them.
    directory = tmp_path / "checkpoints"
    gate = threading.Event()
    disk = Disk(directory, gate=gate).install()
    at_step_2: dict = {}

    def record(module: TinyLM) -> None:
        disk.arm()
        optimizer = module.trainer.optimizers[0]
        at_step_2["params"] = {name: full(p).detach().clone() for name, p in module.named_parameters()}
        at_step_2["steps"] = {float(s["step"]) for s in optimizer.state.values()}

    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)
    strategy = FSDP2Strategy(state_dict_type="full", async_save=True)
    run = trainer(
        tmp_path,
        strategy=strategy,
        max_steps=4,
        callbacks=[AtSteps({2: record, 3: lambda m: gate.set()}), saves],
        enable_checkpointing=True,
    )
    try:
        run.fit(TinyLM(), token_loader(batch_size=4, samples=16))
    finally:
        gate.set()
        disk.uninstall()

    saved = torch.load(directory / "epoch=0-step=2.ckpt", weights_only=True)
    assert saved["state_dict"].keys() >= at_step_2["params"].keys()
    for name, value in at_step_2["params"].items():
        assert torch.equal(saved["state_dict"][name], value), name
    assert {float(s["step"]) for s in saved["optimizer_states"][0]["state"].values()} == at_step_2["steps"] == {2.0}


def test_a_last_background_save_that_fails_is_raised_and_the_stage_still_lets_go_of_the_module(trainer_env, tmp_path):
    # The step-2 save fails in the background; the end of the stage raises it on every rank, and the per-step
    # features (whose hooks hold the module) and the save thread go all the same: in the strategy's teardown, and
    # in the second one Lightning runs after an error in the first.
    directory = tmp_path / "checkpoints"
    disk = Disk(directory, room=0).install()
    saves = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)
    strategy = FSDP2Strategy(state_dict_type="sharded", async_save=True)
    run = trainer(
        tmp_path,
        strategy=strategy,
        max_steps=2,
        callbacks=[AtSteps({1: lambda m: disk.arm()}), saves],
        enable_checkpointing=True,
    )
    try:
        with pytest.raises(CheckpointSaveError, match="no space left on device"):
            run.fit(TinyLM(), token_loader(batch_size=4, samples=16))
    finally:
        disk.uninstall()
    assert list(strategy.step_hooks) == []
    assert strategy.checkpoints.saves._executor is None  # the save thread is stopped
    assert not (directory / "epoch=0-step=2.ckpt").exists()


@pytest.mark.parametrize("kind", ["sharded", "adapter"])
def test_a_checkpoint_io_plugin_that_cannot_write_shards_is_refused_before_training(trainer_env, tmp_path, kind):
    message = (
        "The CheckpointIO plugin RecordingIO saves single checkpoint files, and FSDP2Strategy saves a directory of"
        f" shards (`state_dict_type='{kind}'`) that it cannot write. Pass `FSDP2Strategy(state_dict_type=\"full\")` to"
        " save one file per checkpoint through RecordingIO, as DDP does, or remove the plugin."
    )
    run = trainer(tmp_path, strategy=FSDP2Strategy(state_dict_type=kind), plugins=[RecordingIO()], max_steps=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        run.fit(TinyLM(), token_loader(batch_size=4, samples=16))
    assert run.global_step == 0

    trainer_env.fresh()
    message = (
        "`FSDP2Strategy(async_save=True)` writes checkpoints with its own background thread and cannot run the"
        " CheckpointIO plugin RecordingIO there. Pass `async_save=False`; to save in the background through"
        " RecordingIO, wrap it in `lightning.pytorch.plugins.io.AsyncCheckpointIO`, as with DDP."
    )
    strategy = FSDP2Strategy(state_dict_type="full", async_save=True)
    run = trainer(tmp_path, strategy=strategy, plugins=[RecordingIO()], max_steps=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        run.fit(TinyLM(), token_loader(batch_size=4, samples=16))
    assert run.global_step == 0


def test_storage_options_for_the_default_checkpoint_io_fail_as_under_ddp(trainer_env, tmp_path):
    errors = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp2", FSDP2Strategy(state_dict_type="full"))):
        trainer_env.fresh()
        run = trainer(tmp_path, strategy=strategy, max_steps=1)
        run.fit(TinyLM(), token_loader(batch_size=4, samples=16))
        with pytest.raises(TypeError) as raised:
            run.save_checkpoint(tmp_path / f"{name}.ckpt", storage_options={"tier": "cold"})
        errors[name] = str(raised.value)
    assert errors["fsdp2"] == errors["ddp"]
    assert "storage_options" in errors["ddp"] and not list(tmp_path.glob("*.ckpt"))
    assert not list(tmp_path.glob(".partial-*"))


def test_lightnings_async_checkpoint_io_is_named_with_the_strategys_own_background_saves():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    with pytest.raises(ValueError, match=re.escape("For background saves of shards, use `async_save=True` instead.")):
        saving.check_checkpoint_io(AsyncCheckpointIO(), sharded=True, async_save=False, strategy="FSDP2Strategy")
    with pytest.raises(
        ValueError, match=re.escape("Pass `async_save=False`; AsyncCheckpointIO saves in the background itself.")
    ):
        saving.check_checkpoint_io(AsyncCheckpointIO(), sharded=False, async_save=True, strategy="FSDP2Strategy")
    saving.check_checkpoint_io(AsyncCheckpointIO(), sharded=False, async_save=False, strategy="FSDP2Strategy")
