"""What runs around each training step of a sharded module, one feature per module.

* ``hooks``: ``StepHook``, the points of a step a feature acts at, and ``StepHooks``, the list the strategy calls;
* ``features``: the stage's list of hooks, only the features that apply, in the order they act;
* ``guard``: the opt-in check for NaN/inf gradients before each optimizer step;
* ``unused``: parameters that get no gradient on some ranks (mixture-of-experts routing, branches);
* ``unit_order``: every rank runs the same sharded units in the same order, or the run fails loudly;
* ``buffer_sync``: rank 0's parameters at the start and its buffers at each step, as DDP keeps them;
* ``comm_pool``: reused flat buffers for FSDP2's collectives on CPU;
* ``averaging``: Lightning's ``WeightAveraging`` (EMA) on a sharded module;
* ``hook_view``: whole parameters and gradients for the hooks that read gradients, as under DDP;
* ``sharded_step``: what a sharded root needs around evaluation forwards and manual optimization;
* ``release``: ``host_memory="release"``, free heap pages handed back at each phase end of a step.

``comm_pool`` and ``averaging`` are set up with the sharding of a stage (:mod:`fsdp_strategy.stage`) and act in
the collectives and the optimizer step they serve.
"""
