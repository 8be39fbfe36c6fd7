"""Consolidation of checkpoints that real processes wrote, and the ``python -m fsdp_strategy consolidate`` command in an
interpreter of its own, and Lightning's own consolidation command (moved from tests/test_consolidate.py and
tests/test_trainer_smoke.py: they start processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from fsdp_strategy.checkpoint import state_dicts as ckpt
from fsdp_strategy.tools.consolidate import consolidate_checkpoint
from testkit import free_port
from testkit.checkpoints import assert_same

# The two ranks are started directly (torchrun's launcher would add a third interpreter) and import torch
# only (Lightning's import alone costs seconds of CPU per process): the model is defined here, and the
# package's modules are imported without its __init__ (which imports the strategy, hence Lightning), so
# the layout is exactly the strategy's.
TWO_RANK_SCRIPT = """
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

package = types.ModuleType("fsdp_strategy")
package.__path__ = [sys.argv[3]]
sys.modules["fsdp_strategy"] = package
from fsdp_strategy.checkpoint import state_dicts as ckpt
from fsdp_strategy.checkpoint import writing
from fsdp_strategy.launch import rendezvous


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight
        self.odd = nn.Parameter(torch.randn(5, 3))  # 5 rows split unevenly over 2 ranks

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).square().mean() + self.odd.square().sum()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


dist.init_process_group("gloo")
rendezvous.finish_collectives_at_exit()  # gloo threads finish before Python does (docs/gloo_exit_abort.py)
torch.manual_seed(0)
model = Model()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(2):
    optimizer.zero_grad()
    model(torch.arange(8) + step).backward()
    optimizer.step()
state = optimizer.state_dict()
reference = {
    "params": {name: full(value).clone() for name, value in model.state_dict().items()},
    "optimizer": {
        "state": {i: {k: full(v).clone() for k, v in s.items()} for i, s in state["state"].items()},
        "param_groups": state["param_groups"],
    },
    "local_rows": model.odd.to_local().shape[0],
}
checkpoint = {
    "state_dict": ckpt.model_state(model, full=False),
    "optimizer_states": [ckpt.optimizer_state(model, optimizer, full=False)],
    "global_step": 2,
}
writing.save_sharded(Path(sys.argv[1]), checkpoint, is_rank_zero=dist.get_rank() == 0)
if dist.get_rank() == 0:
    torch.save(reference, sys.argv[2])
dist.barrier()
dist.destroy_process_group()
"""


def _save_on_two_ranks(tmp_path: Path) -> dict:
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANK_SCRIPT)
    port = free_port()
    package = str(Path(ckpt.__file__).parent.parent)  # fsdp_strategy/, above checkpoint/
    command = [sys.executable, str(script), str(tmp_path / "sharded"), str(tmp_path / "reference.pt"), package]
    processes = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        with open(tmp_path / f"rank{rank}.log", "w") as log:
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [process.wait(timeout=180) for process in processes]
    finally:
        for process in processes:
            process.kill()  # no-op for one that has exited
    for rank, code in enumerate(codes):
        assert code == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    return torch.load(tmp_path / "reference.pt", weights_only=False)


def test_a_checkpoint_of_two_ranks_consolidates_in_process_by_python_m_and_by_lightnings_tool(tmp_path):
    reference = _save_on_two_ranks(tmp_path)
    sharded = tmp_path / "sharded"
    assert sorted(p.name for p in sharded.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert reference["local_rows"] == 3  # rank 0 held 3 of the 5 rows, rank 1 two

    out = consolidate_checkpoint(sharded, tmp_path / "out.ckpt", progress=False)
    checkpoint = torch.load(out, weights_only=False)
    assert_same(checkpoint["state_dict"], reference["params"])
    assert_same(checkpoint["optimizer_states"], [reference["optimizer"]])
    assert checkpoint["global_step"] == 2

    # The same directory through `python -m fsdp_strategy consolidate`, in an interpreter of its own.
    by_command = tmp_path / "command.ckpt"
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_strategy", "consolidate", str(sharded), str(by_command), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tensors = sum(
        1 for md in FileSystemReader(sharded).read_metadata().state_dict_metadata.values() if hasattr(md, "size")
    )
    assert result.stdout.startswith(f"{by_command}: {tensors} tensors, ")
    written = torch.load(by_command, weights_only=False)
    assert_same(written["state_dict"], reference["params"])
    assert_same(written["optimizer_states"], [reference["optimizer"]])

    # And through Lightning's own tool, which a user of Lightning's FSDPStrategy would reach for.
    by_lightning = tmp_path / "lightning.ckpt"
    module = "lightning.pytorch.utilities.consolidate_checkpoint"
    result = subprocess.run(
        [sys.executable, "-m", module, str(sharded), "--output_file", str(by_lightning)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same(torch.load(by_lightning, weights_only=True)["state_dict"], reference["params"])
