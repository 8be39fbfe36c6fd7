"""``copy.deepcopy``, ``pickle`` and ``torch.save`` of modules of a sharded model give plain modules with full values,
as under DDP, on a real 1-rank gloo group (``fsdp_strategy.sharding.unshard``); the 2- and 4-rank comparison with DDP is in
``integration_tests/test_finetuning.py``."""

from __future__ import annotations

import copy
import io
import pickle

import lightning as L
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_strategy import FSDP2Strategy
from testkit.models import TinyLM, token_loader


class CopyingLM(TinyLM):
    """Copies the head after its forward (under bf16-mixed the head's group is then gathered in bf16) and the whole
    module, and records what it copied next to the master weights."""

    def __init__(self) -> None:
        super().__init__(n_layer=2)
        self.seen: dict[str, object] = {}
        self.head.register_forward_hook(lambda module, args, output: None)  # a user's hook: it follows the copy

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.loss(batch)
        head = copy.deepcopy(self.head)
        whole = copy.deepcopy(self)
        buffer = io.BytesIO()
        torch.save(self.blocks[0], buffer)
        buffer.seek(0)
        gathered = self.embed.weight  # tied to the head, whose group is gathered now: the bf16 compute copy
        self.seen = {
            "head": head,
            "whole": whole,
            "pickled": pickle.loads(pickle.dumps(self.blocks[1])),
            "saved": torch.load(buffer, weights_only=False),
            "gathered": gathered.detach().clone(),
        }
        return loss


def test_copies_during_a_mixed_precision_step_are_plain_full_precision_modules(trainer_env):
    model = CopyingLM()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FSDP2Strategy(),
        precision="bf16-mixed",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, token_loader(samples=4))
    seen = model.seen
    head, whole = seen["head"], seen["whole"]
    assert seen["gathered"].dtype == torch.bfloat16
    assert type(head) is nn.Linear and head.weight.dtype == torch.float32  # the fp32 master weights, as under DDP
    assert torch.equal(head.weight.to(torch.bfloat16), seen["gathered"])
    assert torch.equal(head.weight, whole.embed.weight)
    assert type(whole) is CopyingLM and whole.head.weight is whole.embed.weight  # tied weights stay tied
    assert not any(isinstance(m, FSDPModule) for m in whole.modules())
    assert not any(isinstance(p, DTensor) for p in whole.parameters())
    assert "training_step" not in vars(whole)  # FSDP's routing of the step method stays with the sharded module
    assert len(whole.head._forward_hooks) == 1 and len(head._forward_hooks) == 1  # the user's hook only
    assert not whole.blocks[0]._forward_pre_hooks  # the strategy's unit recorders stay behind
    for module in (seen["pickled"], seen["saved"]):
        assert type(module).__name__ == "Block" and not any(isinstance(p, DTensor) for p in module.parameters())
    with torch.no_grad():
        whole(torch.zeros(1, 4, dtype=torch.long))  # a working module on its own, no collectives
