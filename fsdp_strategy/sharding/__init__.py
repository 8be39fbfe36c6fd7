"""How a module is split over the ranks and put back together.

* ``mesh``: the device mesh (1-D, or hybrid: replicate across nodes, shard within; with tensor parallelism a last
  ``tensor_parallel`` dimension, named as Lightning's ``ModelParallelStrategy`` names it);
* ``tensor_parallel``: a Hugging Face model's own tensor-parallel plan applied with ``parallelize_module``;
* ``plan``: how a model is sharded in the current world, as a cost model needs to know it;
* ``policy``: which submodules become sharded units;
* ``parallelize``: ``fully_shard`` on those units and the root, activation checkpointing, ``torch.compile``;
* ``frozen``: frozen parameters stored in a lower dtype (bf16, fp16, or torchao's NF4) before sharding;
* ``mixed_precision``: ``Trainer(precision=...)`` as FSDP2 mixed-precision policies (the Lightning precision
  plugins are :mod:`fsdp_strategy.plugins.precision`);
* ``comm_pool``: reused flat buffers for the sharded units' collectives on CPU;
* ``averaging``: Lightning's ``WeightAveraging`` (EMA) with its averaged copy sharded like the module;
* ``hook_view``: whole parameters and gradients of the sharded module for ``on_before_optimizer_step``, as under DDP;
* ``deferred_init`` and ``deferred_replay``: a model built on the meta device, each rank's shards then
  initialized as an eager build would have;
* ``unshard``: the plain module the user built, given back after a stage (as DDP leaves it);
* ``class_names``: the sharded modules' layer types as DDP shows them (``ModelSummary``) during a stage;
* ``pruning``: what a sharded unit cannot do (Lightning's ``ModelPruning``), refused before training;
* ``state_bytes``: the bytes of model state a rank holds, and what they take whole.
"""
