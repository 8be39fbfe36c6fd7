"""The ``fsdp-strategy`` command and what it runs outside training.

* ``cli``: the command (``fsdp-strategy estimate|consolidate|export|benchmark``, also ``python -m fsdp_strategy``);
* ``consolidate``: a sharded checkpoint as one ordinary Lightning file;
* ``export``: a checkpoint's weights as Hugging Face safetensors;
* ``export_peft``: a ``peft`` run's adapters as ``PeftModel.save_pretrained`` writes them;
* ``benchmark``: one model under several strategies and world sizes, on CPU;
* ``progress``: the progress bar of the commands that read a whole checkpoint.
"""
