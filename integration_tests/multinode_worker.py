"""One rank of a simulated multi-node job: trains each strategy in turn and writes what this rank saw.

Each node is started in a directory of its own (``node0/``, ``node1/``: see ``conftest.run_nodes``), by
torchrun (``--nnodes 2 --node-rank R``) or by Lightning's launcher (``NODE_RANK=R``, ``--devices``). Every
rank writes ``{strategy}.{node dir}.local{LOCAL_RANK}.pt`` to ``--out-dir``: the topology as the Trainer,
the strategy and the sampler report it, the sample indices it trained on, and how much model state it
holds; global rank 0 adds the final full parameters. The file names come from the launch, not from
the ranks under test, so a rank that got another rank's identity cannot hide.

Each process logs into ``local{LOCAL_RANK}/`` under its node's directory, so a logger that writes on a
rank other than global rank 0 leaves files where the test looks for none.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

import fsdp_strategy  # noqa: F401  (registers the strategy names)
from integration_tests.worker import Recorder, padded_share_bytes
from testkit.models import TinyLM, token_dataset

SAMPLES, BATCH_SIZE, EPOCHS = 48, 4, 2  # 3 steps per epoch on 4 ranks


class IndexedTokens(Dataset):
    """The integration token data, each sample followed by its index."""

    def __init__(self, samples: int) -> None:
        self.base = token_dataset(samples)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return (*self.base[index], index)


class IndexRecordingLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []  # (epoch, sample index)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets, index = batch
        self.seen += [(self.current_epoch, int(i)) for i in index]
        return super().training_step([tokens, targets], batch_idx)


class TopologyProbe(L.Callback):
    """What this rank is told about the job, read once training has started."""

    def __init__(self) -> None:
        self.report: dict = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        self.share_bytes = {n: padded_share_bytes(pl_module, optimizers, n) for n in (2, 4)}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sampler = trainer.train_dataloader.sampler
        mesh = pl_module.device_mesh
        dtensor = next((p for p in pl_module.parameters() if isinstance(p, DTensor)), None)
        self.report = {
            "node_rank": trainer.node_rank,
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "is_global_zero": trainer.is_global_zero,
            "rank_zero_only_rank": rank_zero_only.rank,
            "process_group_rank": dist.get_rank(),
            "process_group_size": dist.get_world_size(),
            "sampler": (type(sampler).__name__, sampler.num_replicas, sampler.rank, sampler.shuffle),
            "mesh_shape": None if mesh is None else tuple(mesh.shape),
            "mesh_dim_names": None if mesh is None else mesh.mesh_dim_names,
            "mesh_coordinate": None if mesh is None else mesh.get_coordinate(),
            # The ranks this rank shares each mesh dimension with.
            "mesh_groups": None if mesh is None else {name: mesh[name].mesh.tolist() for name in mesh.mesh_dim_names},
            "placements": None if dtensor is None else [type(p).__name__ for p in dtensor.placements],
        }


def train(strategy: str, *, num_nodes: int, devices: int, log_dir: Path) -> dict:
    L.seed_everything(42)
    probe, recorder = TopologyProbe(), Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        num_nodes=num_nodes,
        devices=devices,
        strategy=strategy,
        max_epochs=EPOCHS,
        limit_val_batches=0,
        default_root_dir=log_dir,
        logger=CSVLogger(log_dir, name=strategy),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe, recorder],
    )
    model = IndexRecordingLM()
    trainer.fit(model, DataLoader(IndexedTokens(SAMPLES), batch_size=BATCH_SIZE, shuffle=False))
    rank_zero_info(f"multinode_worker: {strategy} finished")  # the test counts this line over all nodes

    held, _ = recorder.state_bytes  # measured at the end of training, while the module is sharded
    result = {
        **probe.report,
        "seen": model.seen,
        "losses": recorder.losses,
        "state_bytes": held,
        "share_bytes": probe.share_bytes,
    }
    # Collective: every rank takes part, rank 0 keeps the gathered parameters.
    if any(isinstance(p, DTensor) for p in model.parameters()):
        params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        params = model.state_dict()
    if trainer.is_global_zero:
        result["params"] = {k: v.detach().float().cpu() for k, v in params.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="ddp,fsdp2,fsdp2_hybrid", help="comma-separated, trained in turn")
    parser.add_argument("--num-nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, default=None, help="Lightning's launcher: processes per node")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()

    # Lightning's launcher sets LOCAL_RANK only in the processes it starts; its own process is local rank 0.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    devices = args.devices or int(os.environ["LOCAL_WORLD_SIZE"])
    launch_dir = Path.cwd()
    for strategy in args.strategies.split(","):
        result = train(strategy, num_nodes=args.num_nodes, devices=devices, log_dir=launch_dir / f"local{local_rank}")
        torch.save(result, args.out_dir / f"{strategy}.{launch_dir.name}.local{local_rank}.pt")


if __name__ == "__main__":
    main()
