"""Starting and joining the ranks.

* ``process_group``: ``ProcessGroup``, the strategy's process group: joining, barrier and broadcast, a lost peer named;
* ``rendezvous``: joining the process group so that a missing or lost peer has a name and an error;
* ``resume_last``: ``fit(ckpt_path="last")`` when checkpoints are saved to a URL.
"""
