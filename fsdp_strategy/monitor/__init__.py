"""``ShardingMonitor``: what a strategy costs while it trains, in memory, speed and communication.

A Lightning callback that works with any strategy (``"fsdp2"`` and its variants, ``"ddp"``, one
device), so the same run can be compared across them. Per rank it records the peak memory (CUDA:
allocated and reserved; always: the peak resident set size of the process and its growth since fit
set up, before ``configure_model`` and sharding) and the bytes of model state held (local shards of
parameters, gradients and optimizer state). For the run it measures samples/s, tokens/s, TFLOP/s
and, where the device's peak is known, MFU, and it reads the bytes all-gathered, reduce-scattered
and all-reduced per optimizer step from the sharding plan
(:func:`fsdp_strategy.estimator.model_state.estimate_module`). Values are logged to the Trainer's loggers every
``log_every_n_steps`` and summarized in one table when fit ends.

Peaks are those of the fit: CUDA's peak statistics and, on Linux, the process's peak RSS (VmHWM)
are reset when fit sets up, so a second fit in the same process is measured on its own.

No step synchronizes the ranks or the device: batches are timed at their boundaries (CUDA events
on the device), and the ranks exchange their numbers only at logging steps and once at the end.

One module per concern: ``memory`` (RSS and CUDA peaks), ``live`` (the peak bytes of live tensors over
the first steps, what the estimator's step peak predicts), ``batches`` (samples and tokens of a
batch), ``timing`` (step boundaries without synchronizing), ``flops`` (one batch's FLOPs, the
device's peak, MFU), ``plan_costs`` (the sharding plan's communication and model state, from the
estimator), ``summary`` (per-rank rows to the summary and its table) and ``callback`` (the Lightning
hooks calling them). The model state a rank holds is :mod:`fsdp_strategy.sharding.state_bytes`'s count.
"""

from fsdp_strategy.monitor.callback import ShardingMonitor

__all__ = ["ShardingMonitor"]
