"""Memory and communication per rank, predicted before a run from the model's shapes.

* ``groups``: what the strategy would shard, from shapes: its units and each parameter's bytes;
* ``tensor_split``: which parameters tensor parallelism splits (DTensor placements, or a plan of style strings) and
  the activations its layers all-reduce;
* ``model_state``: what each rank keeps and communicates under each strategy (``estimate_module``);
* ``trace`` and ``peak``: one training step on fake tensors, replayed per plan for the step's peak;
* ``fit``: the simplest setting that fits a memory budget;
* ``target``: a model class named as ``MODULE:Class`` (the command line, ``estimate``, the benchmark), or the
  parameters of a Hugging Face weights directory read from its headers;
* ``report``: every strategy at every world size, and the text table of the command;
* ``live_tensors``: bytes of live tensors in a real step, counted storage by storage (the monitor and the
  tests measure with it what ``peak`` predicts).
"""
