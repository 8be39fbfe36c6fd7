"""``fsdp-strategy benchmark``: one model under several strategies and world sizes, side by side, on CPU.

* :mod:`~fsdp_strategy.tools.benchmark.gpt`: the example GPT (the default model) and its sizes;
* :mod:`~fsdp_strategy.tools.benchmark.run`: checks the options, launches the jobs, writes the results;
* :mod:`~fsdp_strategy.tools.benchmark.worker`: one rank of one job, what it trains and measures;
* :mod:`~fsdp_strategy.tools.benchmark.options`: what the two agree on (strategies, precisions, the model by name);
* :mod:`~fsdp_strategy.tools.benchmark.report`: medians, ratios, CSV, JSON, the table and the plot.

Needs the ``benchmarks`` extra (matplotlib, tqdm, psutil): ``pip install 'fsdp-strategy[benchmarks]'``.
"""

from fsdp_strategy.tools.benchmark.options import STRATEGIES
from fsdp_strategy.tools.benchmark.run import run_benchmark

__all__ = ["STRATEGIES", "run_benchmark"]
