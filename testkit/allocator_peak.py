"""The peak of a fit's memory as the allocator itself counts it: an oracle that shares nothing with ``LiveTensors``.

``LiveTensors`` (and so the estimator, which runs it over fake tensors) counts tensor storages; a bug there would
show in the monitor's figure and in the prediction alike. :class:`AllocatorPeak` asks the allocator instead:

* on CPU, glibc's ``mallinfo2()`` (:func:`fsdp_strategy.host_memory.heap_stats`): bytes in use are the heap less
  its free chunks plus the mmapped blocks, which every CPU tensor's storage is one of. It is read after every
  dispatched op (a dispatch mode of its own here, not ``LiveTensors``' ``on_op``) and at the hooks around each
  step, so the peak between two ops is what an op's outputs, the inputs still held and the saved activations
  take together. What it counts besides tensors (C++ autograd nodes, Python objects above pymalloc's 512 bytes,
  malloc's headers and alignment, gloo's copies in its threads) is the tolerance the tests state.
* on CUDA, ``torch.cuda.max_memory_allocated`` (the caching allocator's count of blocks handed out; its reserved
  cache is left out), reset at the start. Nothing in this project's tests needs a GPU: the CUDA branch runs only
  where a fit runs on one.

Run in a fresh interpreter (``python -m testkit.allocator_peak --config fsdp2/32-true/none --out result.json``): a
first 1-rank fit of the benchmark GPT fills the CPU kernels' caches, then a second one is counted at once by this
and by ``ShardingMonitor`` (``LiveTensors``), from the first batch to the end of :data:`testkit.peak_runs.STEPS`
optimizer steps. Both peaks are reported with what was in use before the second model was built, so that each
gives the fit's own bytes: ``integration_tests/test_allocator_peak.py`` compares them with each other and with the
estimator's prediction.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_strategy import host_memory

__all__ = ["AllocatorPeak", "host_in_use"]


def host_in_use() -> int:
    """Bytes the C library's malloc has handed out and not had back (glibc's ``mallinfo2``)."""
    stats = host_memory.heap_stats()
    if stats is None:
        raise RuntimeError("glibc's mallinfo2() is not available here (glibc 2.33 or later on Linux)")
    return stats.heap_bytes - stats.free_bytes + stats.mmapped_bytes


class _Sampler(TorchDispatchMode):
    """Reads the allocator after every op dispatched on this thread (autograd's CPU backward included)."""

    def __init__(self, owner: AllocatorPeak) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.owner.sample()
        return out


class AllocatorPeak(L.Callback):
    """The allocator's peak in-use bytes from the first batch until ``steps`` optimizer steps are done.

    ``start_bytes`` is what was in use when counting began (the first batch), ``peak_bytes`` the largest
    reading after that, ``samples`` how many readings were taken. On CUDA both are ``torch.cuda``'s figures.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.start_bytes: int | None = None
        self.peak_bytes = 0
        self.samples = 0
        self._mode: _Sampler | None = None
        self._cuda = False

    def sample(self) -> None:
        if self._cuda:
            return
        self.peak_bytes = max(self.peak_bytes, host_in_use())
        self.samples += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if self.start_bytes is not None:
            self.sample()
            return
        self._cuda = trainer.strategy.root_device.type == "cuda"
        if self._cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = self.peak_bytes = torch.cuda.memory_allocated()
            return
        self.start_bytes = self.peak_bytes = host_in_use()
        self._mode = _Sampler(self)
        self._mode.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # type: ignore[no-untyped-def]
        self.sample()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        self.sample()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.sample()
        if trainer.global_step >= self.steps:
            self._stop()

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self._stop()

    def on_exception(self, trainer, pl_module, exception) -> None:  # type: ignore[no-untyped-def]
        self._stop()

    def _stop(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated())
            self._cuda = False  # read once
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


def measure(
    config: str, model_args: dict, *, batch_size: int, seq_len: int, warmup: bool = True, accelerator: str = "cpu"
) -> dict[str, Any]:
    """Both peaks of one 1-rank fit of ``config`` (``strategy/precision/checkpointing``) on the benchmark GPT.

    With ``accelerator="cuda"`` both sides count the GPU's memory: ``torch.cuda``'s allocated bytes and the
    monitor's live CUDA tensors (not run by this project's tests, which need no GPU)."""
    from fsdp_strategy import FSDP2Strategy, ShardingMonitor
    from fsdp_strategy.estimator.live_tensors import LiveTensors, existing_tensors
    from fsdp_strategy.sharding.parallelize import apply_activation_checkpointing
    from fsdp_strategy.sharding.policy import normalize_policy, select_modules
    from fsdp_strategy.tools.benchmark.gpt import GPT
    from testkit.peak_runs import STEPS, _loader, parse_config

    strategy, precision, checkpointing = parse_config(config)
    loader = _loader(batch_size, seq_len, model_args.get("vocab_size", 256), 1, 1)

    def fit(callbacks: list[L.Callback]) -> L.Trainer:
        L.seed_everything(0, verbose=False)
        model = GPT(**model_args)
        if strategy == "ddp" and checkpointing is not None:
            apply_activation_checkpointing(
                select_modules(model, normalize_policy(checkpointing, option="checkpointing"))
            )
        trainer = L.Trainer(
            accelerator=accelerator,
            devices=1,
            precision=precision,
            max_steps=STEPS,
            limit_val_batches=0,
            logger=False,
            strategy=strategy
            if strategy == "ddp"
            else FSDP2Strategy(
                reshard_after_forward=strategy != "fsdp2_grad_op", activation_checkpointing_policy=checkpointing
            ),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        trainer.fit(model, loader)
        return trainer

    # A first fit of the same configuration: the CPU kernels' own caches (oneDNN's and BLAS's buffers for each new
    # matmul shape, about 3 MiB in fp32 and 9 MiB in bf16 on this GPT, kept for the process's life and no tensor)
    # fill there, so that the measured fit's growth is its tensors and what the allocator adds to them.
    if warmup:
        fit([])
        gc.collect()
    cuda = accelerator == "cuda"
    # Tensors alive before the model exists (on CPU the loader's), which both peaks include.
    with LiveTensors(device="cuda" if cuda else None) as live:
        live.track(existing_tensors())
        tensors_before = live.current
    allocator_before = torch.cuda.memory_allocated() if cuda else host_in_use()
    allocator = AllocatorPeak(STEPS)
    monitor = ShardingMonitor(warmup_steps=1, count_flops=False, print_summary=False, live_tensor_steps=STEPS)
    fit([monitor, allocator])  # the monitor's mode is entered first: the sampler sees its bookkeeping
    return {
        "live_peak": monitor.summary["ranks"][0]["live_peak_bytes"],
        "tensors_before": tensors_before,
        "allocator_before": allocator_before,
        "allocator_start": allocator.start_bytes,
        "allocator_peak": allocator.peak_bytes,
        "samples": allocator.samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="fsdp2/32-true/none", help="strategy/precision/checkpointing")
    parser.add_argument("--model-args", default="{}", help="the GPT's constructor arguments, a JSON object")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--no-warmup", action="store_true", help="measure the process's first fit")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        os.environ.pop(name, None)  # the fit starts its own 1-rank group
    result = measure(
        args.config,
        json.loads(args.model_args),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        warmup=not args.no_warmup,
        accelerator=args.accelerator,
    )
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
