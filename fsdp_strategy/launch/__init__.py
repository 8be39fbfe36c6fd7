"""Starting and joining the ranks.

* ``process_group``: ``ProcessGroup``, the strategy's process group: joining, barrier and broadcast, a lost peer named;
* ``rendezvous``: joining the process group so that a missing or lost peer has a name and an error; ranks
  agreeing on a flag; a callable run on rank 0 with its error raised on every rank.
"""
