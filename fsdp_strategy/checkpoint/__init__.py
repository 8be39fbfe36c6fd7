"""Checkpoints of sharded models: a Distributed Checkpoint directory, or one full Lightning file.

* ``manager``: ``CheckpointManager``, what the strategy does with checkpoints (format, saves, loads, restores);
* ``io``: what a checkpoint holds and how it is read back (model and optimizer state, full or sharded);
* ``writing``: its files written under a hidden name and put in place;
* ``saving``: a save that ends together on every rank, staged and renamed into place;
* ``background``: saves that run while training goes on;
* ``storage``: where checkpoints live (a local path or an fsspec URL) and the files of one;
* ``dcp_metadata``, ``verify`` and ``trainer_state``: the checks of a checkpoint before anything is loaded;
* ``resume_last``: ``fit(ckpt_path="last")`` when checkpoints are saved to a URL (a launcher that finds it);
* ``reader``: a checkpoint opened once outside training, for the tools (consolidate, export);
* ``weights``: its model weights tensor by tensor, each read in blocks (the Hugging Face export);
* ``pretrained``: Hugging Face weights (``save_pretrained``'s safetensors) read into shards, each rank its rows;
* ``errors``: ``CheckpointError``, which names the checkpoint and the broken file;
* ``optimizer_state``: an optimizer's state in and out of checkpoints, as the optimizer holds it.
"""
