"""A rank aborts at interpreter exit after its work is done: torch and gloo alone (no Lightning, no fsdp_strategy).

    python -m torch.distributed.run --standalone --nproc-per-node=2 docs/gloo_exit_abort.py [--with-workaround]

On this project's machine (torch 2.13.0+cpu, Python 3.11.7) 23 of 40 launches ended with "terminate called without
an active exception" and exit status -6 on a rank that had printed "done". A backtrace (gdb, thread
"pt_gloo_runloop") shows c10d::ProcessGroupGloo::runLoop destroying a finished AsyncBarrierWork, whose prior works
(the all-gather queued before the barrier) release their tensors, which takes the GIL
(TensorImpl::decref_pyobject -> pybind11::gil_scoped_acquire); the main thread is in Py_FinalizeEx by then, so
take_gil() calls PyThread_exit_thread(), pthread_exit's forced unwind crosses a destructor that may not throw, and
std::terminate aborts the process.

Workarounds measured on the same 40 launches: an exit handler that sleeps 50 ms (`atexit.register(time.sleep,
0.05)`), which lets the worker take the GIL before finalization: 0 of 40 aborted; `dist.destroy_process_group()` in
an exit handler: 0 of 40. FSDP2Strategy registers the first (`fsdp_strategy.launch.rendezvous.finish_collectives_at_exit`).
"""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if "--with-workaround" in sys.argv:  # what FSDP2Strategy does (integration_tests/test_exit_status.py launches this)
    from fsdp_strategy.launch import rendezvous

    rendezvous.finish_collectives_at_exit()
for _ in range(20):
    out = torch.empty(2 * 1024)
    work = dist.all_gather_into_tensor(out, torch.ones(1024), async_op=True)  # tensors owned by Python
    dist.barrier()  # gloo's barrier keeps the works still queued or running as its "prior work"
    work.wait()
    del work, out
print(f"rank {dist.get_rank()} done", flush=True)
# End of script: a gloo worker thread may destroy the barrier (and the all-gather it holds) only now, while the
# interpreter finalizes; releasing the all-gather's tensors needs the GIL, the thread is made to exit instead,
# and the forced unwind through a noexcept destructor calls std::terminate.
