"""Train a small byte-level GPT with FSDP2 through Lightning's own launcher.

    python examples/train_gpt.py                   # FSDP2 + bf16-mixed, 2 CPU processes (or all GPUs)
    python examples/train_gpt.py --strategy ddp    # the same job with DDP
    python examples/train_gpt.py --strategy fsdp2_grad_op --precision 32-true --max-steps 300

No ``torchrun`` needed: ``Trainer(devices=N)`` starts the other processes itself. At the end, rank 0 prints the
``ShardingMonitor`` table (peak memory and model state of each rank, samples/s, tokens/s, TFLOP/s, MFU where the
device's peak is known, and the communication per step of the sharding plan) and the final losses.
"""

import argparse
import collections
import math
import os
import tempfile
import time

import lightning as L
import torch
from gpt import GPT, ByteTextDataModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

import fsdp_strategy  # registers the strategy names ("fsdp2", "fsdp2_hybrid", "fsdp2_tp", ...)
from fsdp_strategy import ShardingMonitor


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--strategy", default="fsdp2", help="any registered strategy name: fsdp2, ddp, ...")
    p.add_argument("--precision", default="bf16-mixed", help="bf16-mixed, 32-true, bf16-true, ...")
    p.add_argument("--devices", type=int, default=None, help="default: all GPUs, else 2 CPU processes")
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--accumulate-grad-batches", type=int, default=1)
    p.add_argument("--gradient-clip-val", type=float, default=1.0)
    p.add_argument("--limit-val-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "train_gpt"))
    p.add_argument("--checkpoint", action="store_true", help="save a checkpoint at the end (off: faster)")
    return p.parse_args()


class LossSummary(Callback):
    """Keeps the last training losses and, at the end, averages them over every rank."""

    def __init__(self, last: int = 10) -> None:
        self.recent_losses = collections.deque(maxlen=last)
        self.train_loss = math.nan

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning divides the returned loss by accumulate_grad_batches; undo that for reporting
        self.recent_losses.append(outputs["loss"].detach() * trainer.accumulate_grad_batches)

    def on_train_end(self, trainer, pl_module) -> None:
        loss = torch.stack(list(self.recent_losses)).mean() if self.recent_losses else torch.tensor(math.nan)
        # every rank reaches on_train_end, so every rank joins this reduction
        self.train_loss = trainer.strategy.reduce(loss.to(trainer.strategy.root_device), reduce_op="mean").item()


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    L.seed_everything(args.seed, workers=True)
    on_gpu = torch.cuda.is_available()
    devices = args.devices or (torch.cuda.device_count() if on_gpu else 2)
    # CPU threads: Lightning's launcher already sets OMP_NUM_THREADS / torch.set_num_threads to
    # (CPU cores // processes) unless OMP_NUM_THREADS is set, i.e. 1 thread per rank for 2 ranks on 2 cores.

    data = ByteTextDataModule(block_size=args.block_size, batch_size=args.batch_size)
    losses = LossSummary()
    # Logs memory, throughput and communication every log_every_n_steps and prints a table when fit ends.
    monitor = ShardingMonitor(warmup_steps=10)
    train_batches = args.max_steps * args.accumulate_grad_batches
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=devices,
        strategy=args.strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate_grad_batches,
        gradient_clip_val=args.gradient_clip_val or None,
        val_check_interval=train_batches,  # validate once, after the last training batch
        check_val_every_n_epoch=None,
        limit_val_batches=args.limit_val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        logger=CSVLogger(args.output_dir, name="train_gpt"),
        enable_checkpointing=args.checkpoint,
        default_root_dir=args.output_dir,
        callbacks=[losses, monitor],
    )
    # With FSDP2 the model is created on the meta device (no memory) and each rank initializes only its own
    # shards after sharding, through the modules' reset_parameters(). Other strategies build it normally.
    with trainer.init_module(empty_init=isinstance(trainer.strategy, fsdp_strategy.FSDP2Strategy)):
        model = GPT(
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
            learning_rate=args.learning_rate,
            weight_decay=0.1,
            warmup_steps=10,
            lr_schedule="cosine",
        )
    trainer.fit(model, datamodule=data)

    if trainer.is_global_zero:
        print_summary(args, trainer, model, losses, time.perf_counter() - t0)


def print_summary(args, trainer, model, losses: LossSummary, seconds: float) -> None:
    device = trainer.strategy.root_device
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    val_loss = float(trainer.callback_metrics.get("val_loss", math.nan))
    print(
        f"{n_params:.2f}M params | final train loss {losses.train_loss:.4f} (last 10 batches, all ranks)"
        f" | val loss {val_loss:.4f}"
    )
    print(f"{seconds:.1f} s since the start of main() | logs: {trainer.logger.log_dir}")
    if device.type == "cpu" and "bf16" in args.precision and not cpu_has_bf16():
        print("note: this CPU has no native bf16, so bf16 matmuls are emulated; --precision 32-true is much faster")


def cpu_has_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return check is None or bool(check())


if __name__ == "__main__":
    main()
