"""What runs around each training step of a sharded module, one feature per module.

* ``hooks``: ``StepHook``, the points of a step a feature acts at, and ``StepHooks``, the list the strategy calls;
* ``features``: the stage's list of hooks, only the features that apply, in the order they act;
* ``guard``: the opt-in check for NaN/inf gradients before each optimizer step;
* ``unused``: parameters that get no gradient on some ranks (mixture-of-experts routing, branches);
* ``unit_order``: every rank runs the same sharded units in the same order, or the run fails loudly;
* ``buffer_sync``: rank 0's parameters at the start and its buffers at each step, as DDP keeps them;
* ``sharded_step``: what a sharded root needs around evaluation forwards and manual optimization;
* ``release``: ``host_memory="release"``, free heap pages handed back at each phase end of a step.

What a stage's sharding sets up once and that then acts by itself, not at points of a step (the pooled collective
buffers, WeightAveraging's sharded copy, the whole parameters that ``on_before_optimizer_step`` sees), lives in
:mod:`fsdp_strategy.sharding`.
"""
