"""Checkpoints of sharded models: a Distributed Checkpoint directory, or one full Lightning file.

* ``manager``: ``CheckpointManager``, what the strategy does with checkpoints, dispatched to a format;
* ``formats``: the checkpoint formats as classes (``ShardedFormat``, ``FullFormat``, ``AdapterFormat``) and which one a
  path holds;
* ``adapter_base``: what an adapter checkpoint records of the base its frozen parameters come from;
* ``peft_record``: the names and configs of a ``peft`` model's adapters, recorded in its checkpoints for the export;
* ``location``: where a checkpoint is (a local path or an fsspec URL, decided once) and what is done there;
* ``layout``: a checkpoint dict in its parts (module, optimizers, sharded callback state, trainer state);
* ``state_dicts``: model and optimizer state taken for a save (full or sharded) and read back into them;
* ``writing``: its files written under a hidden name and put in place;
* ``saving``: a save that ends together on every rank, staged and renamed into place;
* ``staging``: the hidden names saves are written under, and those crashed runs left removed;
* ``background``: saves that run while training goes on;
* ``storage``: the files of one checkpoint, and the manifests that name sharded ones on URLs;
* ``dcp_metadata``, ``verify`` and ``trainer_state``: the checks of a checkpoint before anything is loaded;
* ``resume_last``: ``fit(ckpt_path="last")`` when checkpoints are saved to a URL (a launcher that finds it);
* ``reader``: a checkpoint opened once outside training, for the tools (consolidate, export);
* ``weights``: its model weights tensor by tensor, each read in blocks (the Hugging Face export);
* ``pretrained``: Hugging Face weights (``save_pretrained``'s safetensors) read into shards, each rank its rows;
* ``errors``: ``CheckpointError``, which names the checkpoint and the broken file;
* ``optimizer_state``: an optimizer's state in and out of checkpoints, as the optimizer holds it.
"""
