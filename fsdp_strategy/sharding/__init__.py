"""How a module is split over the ranks and put back together.

* ``mesh``: the device mesh (1-D, or hybrid: replicate across nodes, shard within);
* ``policy``: which submodules become sharded units;
* ``parallelize``: ``fully_shard`` on those units and the root, activation checkpointing, ``torch.compile``;
* ``precision``: ``Trainer(precision=...)`` as FSDP2 mixed-precision policies and precision plugins;
* ``deferred_init`` and ``deferred_replay``: a model built on the meta device, each rank's shards then
  initialized as an eager build would have;
* ``unshard``: the plain module the user built, given back after a stage (as DDP leaves it);
* ``class_names``: the sharded modules' layer types as DDP shows them (``ModelSummary``) during a stage;
* ``pruning``: what a sharded unit cannot do (Lightning's ``ModelPruning``), refused before training;
* ``state_bytes``: the bytes of model state a rank holds, and what they take whole.
"""
