"""What runs around each training step of a sharded module, one feature per module.

* ``guard``: the opt-in check for NaN/inf gradients before each optimizer step;
* ``unused``: parameters that get no gradient on some ranks (mixture-of-experts routing, branches);
* ``unit_order``: every rank runs the same sharded units in the same order, or the run fails loudly;
* ``buffer_sync``: rank 0's parameters at the start and its buffers at each step, as DDP keeps them;
* ``comm_pool``: reused flat buffers for FSDP2's collectives on CPU;
* ``host_memory``: free heap pages handed back to the system, and the host memory available;
* ``averaging``: Lightning's ``WeightAveraging`` (EMA) on a sharded module;
* ``hook_view``: whole parameters and gradients for ``on_before_optimizer_step``, as under DDP.
"""
