"""Lightning plugins for sharded modules, as Lightning keeps its own in ``lightning.pytorch.plugins``.

* ``precision``: ``Trainer(precision=...)`` as precision plugins that run on shards (autocast, loss scaling agreed
  across ranks, whole parameters in ``on_before_optimizer_step``), and Lightning's own plugins translated into them.
* ``clipping``: clipping by norm over gradients on several device meshes (tensor parallelism inside FSDP2).
"""
