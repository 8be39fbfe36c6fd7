"""Starting and joining the ranks.

* ``rendezvous``: joining the process group so that a missing or lost peer has a name and an error;
* ``resume_last``: ``fit(ckpt_path="last")`` when checkpoints are saved to a URL.
"""
