"""What the running ``trainer.fit``/``validate``/``test``/``predict`` call was given, where Lightning drops it."""

from __future__ import annotations

import inspect

__all__ = ["weights_only_of_trainer_call"]


def weights_only_of_trainer_call() -> bool | None:
    """The ``weights_only`` passed to the running Trainer call (``None``: not given, or no call running).

    Lightning (checked up to 2.6.6) hands it to ``Strategy.load_checkpoint`` only for strategies that
    restore before setup: ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it
    when ``restore_checkpoint_after_setup`` is true, as for FSDP2Strategy, whose model must be sharded
    before it is loaded. No public API holds the value, so it is read from the ``Trainer._run`` frame on
    this thread's stack. Should that method be renamed, this returns ``None``: torch's safe default.
    """
    from lightning.pytorch.trainer.trainer import Trainer

    run = getattr(Trainer._run, "__code__", None)
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is run:
                value = frame.f_locals.get("weights_only")
                return value if isinstance(value, bool) else None
            frame = frame.f_back
        return None
    finally:
        del frame  # frames hold their locals alive
