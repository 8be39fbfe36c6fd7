"""Peak host memory per rank of loading pretrained Hugging Face weights under "fsdp2" with ``meta_init``.

    OMP_NUM_THREADS=1 python benchmarks/pretrained_load_memory.py [--ranks 2,4] [--tmp /tmp] [--layers 4]
        [--tensor-parallel-size 1]

1. In one process: a Llama built from a config (hidden 2048, MLP 5632, ``--layers`` layers, vocabulary 32000,
   untied head: 1.35 GB of fp32 weights at 4 layers), ``save_pretrained`` to ``--tmp`` in files of at most 500 MB
   (an index and its files), and the same weights as one plain state-dict file (``torch.save``) for the rank-0 path.
2. For each number of ranks, ``torch.distributed.run`` runs this file with ``--load``: a LightningModule that builds
   the model from its config in ``configure_model``, ``Trainer(strategy=FSDP2Strategy(init_weights=..., meta_init=True),
   max_steps=0)``, with ``tensor_parallel_size`` when given (the Llama split by its ``base_model_tp_plan``). Once with the Hugging Face directory (each rank reads its rows), once with the state-dict file
   (the rank-0 path: rank 0 reads it, every rank receives each tensor whole and keeps its shard).
   The RSS is taken in the callback's ``setup``, before the model is built. The loading is the strategy's own
   call (``CheckpointManager._load_init_weights``, wrapped here): freed heap memory is handed back and the peak RSS
   reset (``/proc/self/clear_refs``) right before it, and its peak (VmHWM) read right after it.
Reported per rank: the peak RSS during loading over the RSS before the model was built (the rank's shards, which
meta_init allocated just before, plus what loading needed), of which the RSS right before loading, the rank's shard bytes, the largest tensor's bytes, the
goal ``(shard + largest tensor) * 1.1``, and the peak of the whole setup (from the callback's ``setup`` to
``on_fit_start``: sharding, materialization, loading, optimizers; the strategy gathers no unit there since 897b6dd,
where finding FSDP2's gathered parameters gathered every unit, the embedding and the head together the largest).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20


def config(layers: int) -> dict:
    return {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }


def create(directory: Path, layers: int) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config(layers)))
    model.save_pretrained(directory / "hf", max_shard_size="500MB")
    del model
    state = {}
    for file in sorted((directory / "hf").glob("model-*.safetensors")):
        state.update({f"model.{k}": v for k, v in load_file(file).items()})
    torch.save(state, directory / "weights.pt")


def load(weights: str, out: str, tensor_parallel_size: int) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.tensor import DTensor

    from fsdp_strategy import FSDP2Strategy, host_memory
    from fsdp_strategy.checkpoint.manager import CheckpointManager
    from fsdp_strategy.monitor.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from testkit.hf import PretrainedLlama
    from testkit.models import token_loader

    class Measure(Callback):
        def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
            self.start = current_rss_bytes()
            reset_peak_rss()

        def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            params = list(module.parameters())
            row = {
                "rank": trainer.global_rank,
                "load": loading["peak"] - self.start,
                "before": loading["before"] - self.start,
                "setup": max(loading["setup_peak"], peak_rss_bytes(), current_rss_bytes()) - self.start,
                "shard": sum(p.to_local().numel() * p.element_size() for p in params if isinstance(p, DTensor)),
                "largest": max(p.numel() * p.element_size() for p in params),
            }
            rows = [None] * trainer.world_size
            torch.distributed.all_gather_object(rows, row)
            if trainer.is_global_zero:
                Path(out).write_text(json.dumps(rows))

    loading: dict[str, int] = {}
    strategy_load = CheckpointManager._load_init_weights

    def measured_load(manager: CheckpointManager, model: torch.nn.Module) -> None:
        loading["setup_peak"] = max(peak_rss_bytes(), current_rss_bytes())
        host_memory.release()
        reset_peak_rss()
        loading["before"] = current_rss_bytes()
        strategy_load(manager, model)
        loading["peak"] = max(peak_rss_bytes(), current_rss_bytes())

    CheckpointManager._load_init_weights = measured_load  # type: ignore[method-assign]

    hf = Path(weights).is_dir()
    model_config = json.loads(((Path(weights) if hf else Path(weights).parent / "hf") / "config.json").read_text())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=FSDP2Strategy(
            init_weights=weights, meta_init=True, state_dict_type="sharded", tensor_parallel_size=tensor_parallel_size
        ),
        max_steps=0,
        callbacks=[Measure()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(PretrainedLlama(model_config), token_loader())


def run_ranks(script: str, ranks: int, arguments: list[str], out: Path) -> Any:
    """``script`` with ``arguments`` under ``torch.distributed.run`` on ``ranks`` processes; what it wrote to ``out``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", script]
    command += [*arguments, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def run(weights: Path, ranks: int, out: Path, tensor_parallel_size: int) -> list[dict]:
    arguments = ["--load", str(weights), "--tensor-parallel-size", str(tensor_parallel_size)]
    return run_ranks(__file__, ranks, arguments, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--tmp", default="/tmp")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--load")
    parser.add_argument("--out")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    if args.load:
        return load(args.load, args.out, args.tensor_parallel_size)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        directory = Path(tmp)
        create(directory, args.layers)
        total = sum(f.stat().st_size for f in (directory / "hf").glob("*.safetensors"))
        print(
            f"model: {total / MiB:.0f} MiB of fp32 weights in {len(list((directory / 'hf').glob('*.safetensors')))} files"
        )
        print(
            "| ranks | source | rank | loading: peak RSS growth | of which before loading | shard | largest tensor"
            " | goal: (shard + largest) x 1.1 | loading / goal | whole setup: peak RSS growth |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for source, weights in (
                ("HF directory, each rank its rows", directory / "hf"),
                ("state-dict file, rank 0", directory / "weights.pt"),
            ):
                for row in run(weights, ranks, directory / "rows.json", args.tensor_parallel_size):
                    goal = (row["shard"] + row["largest"]) * 1.1
                    print(
                        f"| {ranks} | {source} | {row['rank']} | {row['load'] / MiB:.0f} MiB | {row['before'] / MiB:.0f} MiB | {row['shard'] / MiB:.0f}"
                        f" MiB | {row['largest'] / MiB:.0f} MiB | {goal / MiB:.0f} MiB | {row['load'] / goal:.2f}"
                        f" | {row['setup'] / MiB:.0f} MiB |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
