"""Checkpoint helpers on a real 1-rank group: sharded (DCP) round trip and loading a full Lightning checkpoint."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from fsdp_strategy.checkpoint import state_dicts as ckpt
from fsdp_strategy.checkpoint import writing
from fsdp_strategy.checkpoint.layout import split_checkpoint
from fsdp_strategy.checkpoint.trainer_state import TRAINER_STATE_FILENAME
from fsdp_strategy.checkpoint.verify import is_sharded_checkpoint
from fsdp_strategy.sharding.parallelize import (
    apply_fully_shard,
    load_full_tensors_into_shards,
    plan_units,
)
from fsdp_strategy.sharding.policy import normalize_policy
from testkit import full
from testkit.models import TinyLM, token_loader


def sharded_tinylm(mesh, seed: int) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM()
    units = plan_units(
        model, normalize_policy("auto", option="wrap_policy"), mp_policy=MixedPrecisionPolicy(), keep_norms_fp32=False
    )
    apply_fully_shard(
        model,
        units,
        mesh,
        root_mp_policy=MixedPrecisionPolicy(),
        offload_policy=OffloadPolicy(),
        reshard_after_forward=True,
    )
    return model


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: TinyLM, optimizer: torch.optim.Optimizer, batch_idx: int = 0) -> None:
    batch = list(token_loader(batch_size=4, samples=8))[batch_idx]
    optimizer.zero_grad()
    model.loss(batch).backward()
    optimizer.step()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p).detach().clone() for name, p in model.named_parameters()}


def optimizer_state_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    return {
        name: {key: full(value).clone() for key, value in optimizer.state[param].items()}
        for name, param in model.named_parameters()
    }


def assert_states_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        if isinstance(expected[name], dict):
            assert_states_equal(actual[name], expected[name])
        else:
            assert torch.equal(actual[name], expected[name]), name


def test_sharded_round_trip_is_bit_exact_for_model_and_optimizer(mesh, tmp_path):
    model = sharded_tinylm(mesh, seed=0)
    optimizer = adamw(model)
    train_step(model, optimizer)
    saved_params = full_params(model)
    saved_optimizer = optimizer_state_by_name(model, optimizer)

    path = tmp_path / "step=1"
    checkpoint = {
        "state_dict": ckpt.model_state(model, full=False),
        "optimizer_states": [ckpt.optimizer_state(model, optimizer, full=False)],
        "global_step": 1,
        "epoch": 0,
    }
    assert all(isinstance(t, DTensor) for t in checkpoint["state_dict"].values())
    writing.save_sharded(path, checkpoint, is_rank_zero=True)
    assert (path / TRAINER_STATE_FILENAME).is_file()
    assert (path / ".metadata").is_file()  # DCP's own index
    assert is_sharded_checkpoint(path)

    restored = sharded_tinylm(mesh, seed=1)
    restored_optimizer = adamw(restored)
    assert not torch.equal(full(restored.blocks[0].attn_q.weight), saved_params["blocks.0.attn_q.weight"])
    trainer_state = ckpt.read_sharded(path, restored, strict=True)  # the module's state in place, as the file holds it
    ckpt.load_sharded_optimizers(path, restored, [restored_optimizer], trainer_state["optimizer_states"])

    assert trainer_state.keys() == {"global_step", "epoch", "state_dict", "optimizer_states"}
    assert trainer_state["global_step"] == 1 and trainer_state["epoch"] == 0
    assert all(isinstance(t, DTensor) for t in trainer_state["state_dict"].values())
    assert_states_equal(full_params(restored), saved_params)
    assert_states_equal(optimizer_state_by_name(restored, restored_optimizer), saved_optimizer)
    assert restored.head.weight is restored.embed.weight

    # The restored pair continues exactly like the original.
    train_step(model, optimizer, batch_idx=1)
    train_step(restored, restored_optimizer, batch_idx=1)
    assert_states_equal(full_params(restored), full_params(model))


class CountingSGD(torch.optim.SGD):
    """Plain SGD (no state ever) that counts its steps."""

    def __init__(self, params) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, lr=0.1)
        self.steps = 0

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        self.steps += 1
        return super().step(closure)


def test_saving_and_loading_optimizer_state_never_steps_the_optimizer_nor_drops_gradients(mesh, tmp_path):
    # torch's get_/set_optimizer_state_dict step an optimizer without state (lr 0) and zero_grad() it; DDP never does.
    model = sharded_tinylm(mesh, seed=0)
    optimizer = CountingSGD(model.parameters())
    model.loss(list(token_loader(batch_size=4, samples=8))[0]).backward()  # gradients of a step not taken yet
    grads = {name: full(p.grad).clone() for name, p in model.named_parameters()}
    before = full_params(model)
    sharded = ckpt.optimizer_state(model, optimizer, full=False)
    whole = ckpt.optimizer_state(model, optimizer, full=True)
    assert sharded["state"] == {} and whole["state"] == {}
    assert sharded["param_groups"][0]["params"] == [name for name, _ in model.named_parameters()]
    assert whole["param_groups"][0]["params"] == list(range(len(list(model.parameters()))))
    writing.save_sharded(
        tmp_path / "ck",
        {"state_dict": ckpt.model_state(model, full=False), "optimizer_states": [sharded]},
        is_rank_zero=True,
    )
    ckpt.load_sharded_optimizers(tmp_path / "ck", model, [optimizer], [sharded])
    ckpt.load_full_optimizers([optimizer], [whole])
    assert optimizer.steps == 0
    assert_states_equal(full_params(model), before)
    assert_states_equal({name: full(p.grad) for name, p in model.named_parameters()}, grads)


def test_the_stand_in_optimizer_of_a_fit_without_one_stays_with_the_trainer_state():
    # `configure_optimizers` returning None: Lightning's stand-in saves `{}`, which DCP would not write at all.
    tensors, rest = split_checkpoint({"state_dict": {}, "optimizer_states": [{}], "epoch": 1})
    assert set(tensors) == {"model"}
    assert rest == {"optimizer_states": [{}], "epoch": 1}
    tensors, rest = split_checkpoint({"state_dict": {}, "optimizer_states": [{"state": {}, "param_groups": []}]})
    assert set(tensors) == {"model", "optimizer_0"} and "optimizer_states" not in rest


def test_a_file_or_a_plain_directory_is_not_a_sharded_checkpoint(tmp_path):
    plain_file = tmp_path / "model.ckpt"
    plain_file.write_bytes(b"")
    assert not is_sharded_checkpoint(plain_file)
    assert not is_sharded_checkpoint(tmp_path)
    assert not is_sharded_checkpoint(tmp_path / "missing")


def test_load_full_from_a_plain_lightning_checkpoint_with_index_keyed_optimizer_state(mesh, tmp_path):
    torch.manual_seed(0)
    plain = TinyLM()
    plain_optimizer = adamw(plain)
    train_step(plain, plain_optimizer)
    # What DDP / a single device writes: full tensors, optimizer state keyed 0..N-1. Read back from
    # disk so that the checkpoint shares no storage with the live plain model.
    torch.save(
        {"state_dict": plain.state_dict(), "optimizer_states": [plain_optimizer.state_dict()], "global_step": 1},
        tmp_path / "plain.ckpt",
    )
    checkpoint = ckpt.read_full_checkpoint(tmp_path / "plain.ckpt", weights_only=True)
    assert set(checkpoint["optimizer_states"][0]["state"]) == set(range(len(list(plain.parameters()))))

    model = sharded_tinylm(mesh, seed=1)
    load_full_tensors_into_shards(model)  # the strategy lets a sharded module load full tensors as DDP's does
    optimizer = adamw(model)
    ckpt.check_full_state_dict(model, checkpoint["state_dict"], strict=True, path=tmp_path / "plain.ckpt")
    model.load_state_dict(checkpoint["state_dict"])
    ckpt.load_full_optimizers([optimizer], checkpoint["optimizer_states"])

    assert_states_equal(full_params(model), {name: p.detach() for name, p in plain.named_parameters()})
    assert_states_equal(optimizer_state_by_name(model, optimizer), optimizer_state_by_name(plain, plain_optimizer))

    # The full forms read back as Lightning writes them: plain CPU tensors, index-keyed optimizer state.
    model_full = ckpt.model_state(model, full=True)
    assert model_full.keys() == plain.state_dict().keys()
    assert not any(isinstance(t, DTensor) for t in model_full.values())
    assert_states_equal(model_full, plain.state_dict())
    optimizer_full = ckpt.optimizer_state(model, optimizer, full=True)
    expected = plain_optimizer.state_dict()
    assert_states_equal(optimizer_full["state"], expected["state"])
    assert [g["params"] for g in optimizer_full["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert optimizer_full["param_groups"][0]["lr"] == expected["param_groups"][0]["lr"]

    train_step(plain, plain_optimizer, batch_idx=1)
    train_step(model, optimizer, batch_idx=1)
    for name, param in plain.named_parameters():
        torch.testing.assert_close(full(dict(model.named_parameters())[name]), param, msg=name)


def test_init_weights_fills_a_sharded_model_from_a_full_file(trainer_env, tmp_path):
    import lightning as L

    from fsdp_strategy import FSDP2Strategy

    torch.manual_seed(1)
    source = TinyLM()
    torch.save({"state_dict": source.state_dict()}, tmp_path / "weights.ckpt")
    torch.manual_seed(2)
    model = TinyLM()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(init_weights=str(tmp_path / "weights.ckpt")),
        max_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, token_loader())
    for name, tensor in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name  # after fit the module is plain again


def test_init_weights_must_be_an_existing_file(tmp_path):
    from fsdp_strategy import FSDP2Strategy

    missing = tmp_path / "nope.pt"
    message = (
        "`init_weights` must name an existing weights file or a Hugging Face weights directory; got"
        f" '{missing}', which is neither."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        FSDP2Strategy(init_weights=str(missing))


def test_a_truncated_full_checkpoint_file_is_named_without_the_zip_readers_message(tmp_path):
    from fsdp_strategy import CheckpointError

    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": TinyLM().state_dict()}, path)
    path.write_bytes(path.read_bytes()[:1000])
    message = (
        f"Checkpoint '{path}' is damaged: 'model.ckpt' is not a complete checkpoint file (truncated, or not"
        " written by torch.save): RuntimeError."
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ckpt.read_full_checkpoint(path, weights_only=True)


def test_a_full_checkpoint_without_a_state_dict_or_missing_is_named(tmp_path):
    from fsdp_strategy import CheckpointError

    path = tmp_path / "weights.pt"
    torch.save({"weights": torch.zeros(1)}, path)
    message = f"Checkpoint '{path}' is not a Lightning checkpoint: 'weights.pt' has no 'state_dict' entry."
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ckpt.read_full_checkpoint(path, weights_only=True)
    with pytest.raises(FileNotFoundError, match=re.escape(f"Checkpoint '{tmp_path / 'nope.ckpt'}' does not exist.")):
        ckpt.read_full_checkpoint(tmp_path / "nope.ckpt", weights_only=True)


def test_a_full_checkpoint_of_another_model_names_the_mismatching_keys(mesh, tmp_path):
    from fsdp_strategy import CheckpointError

    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": TinyLM(n_layer=4).state_dict()}, path)
    model = sharded_tinylm(mesh, seed=1)
    with pytest.raises(
        CheckpointError, match=re.escape(f"Checkpoint '{path}' was saved from a different model")
    ) as error:
        ckpt.check_full_state_dict(
            model, ckpt.read_full_checkpoint(path, weights_only=True)["state_dict"], strict=True, path=path
        )
    assert "unexpected key" in str(error.value) and "blocks.3." in str(error.value)


class NotPlainData:
    pass


def test_a_full_checkpoint_with_objects_is_refused_under_weights_only(tmp_path):
    from fsdp_strategy import CheckpointError

    path = tmp_path / "objects.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"thing": NotPlainData()}}, path)
    message = (
        f"Checkpoint '{path}' is refused: 'objects.ckpt' contains objects that are not plain data, so it was not"
        " unpickled. If you trust this file, pass `trainer.fit(..., weights_only=False)`."
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ckpt.read_full_checkpoint(path, weights_only=True)
    assert ckpt.read_full_checkpoint(path, weights_only=False)["hyper_parameters"]["thing"].__class__ is NotPlainData


def test_init_weights_file_that_is_damaged_or_holds_no_state_dict_is_named(tmp_path):
    from fsdp_strategy import CheckpointError

    truncated = tmp_path / "weights.pt"
    torch.save(TinyLM().state_dict(), truncated)
    truncated.write_bytes(truncated.read_bytes()[:1000])
    message = (
        f"Checkpoint '{truncated}' is damaged: 'weights.pt' is not a complete checkpoint file (truncated, or not"
        " written by torch.save): RuntimeError."
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ckpt.read_full_weights(truncated)

    not_weights = tmp_path / "list.pt"
    torch.save([1, 2], not_weights)
    message = (
        f"`init_weights` file '{not_weights}' holds no state dict: expected a Lightning checkpoint with a"
        " 'state_dict' entry or a plain {name: tensor} dict."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        ckpt.read_full_weights(not_weights)


def test_an_unreadable_init_weights_file_fails_setup_with_its_reason(trainer_env, tmp_path):
    import lightning as L

    from fsdp_strategy import FSDP2Strategy

    path = tmp_path / "weights.pt"
    torch.save(TinyLM().state_dict(), path)
    path.write_bytes(path.read_bytes()[:1000])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(init_weights=str(path)),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    message = (
        f"Could not read `init_weights` '{path}' on rank 0: Checkpoint '{path}' is damaged: 'weights.pt' is not a"
        " complete checkpoint file (truncated, or not written by torch.save): RuntimeError."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.fit(TinyLM(), token_loader())
