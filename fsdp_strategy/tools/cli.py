"""The ``fsdp-strategy`` command (also ``python -m fsdp_strategy``)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "main", "parse_init_args", "parse_strategies", "parse_world_sizes"]


def _env(_: argparse.Namespace) -> int:
    import lightning
    import torch
    from lightning.pytorch.strategies import StrategyRegistry

    import fsdp_strategy

    names = sorted(name for name, entry in StrategyRegistry.items() if entry["strategy"] is fsdp_strategy.FSDP2Strategy)
    print(f"fsdp-strategy {fsdp_strategy.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}")
    print(f"CUDA devices: {torch.cuda.device_count()}")
    print(f"strategy names: {', '.join(names)}")
    print(f"precisions: {', '.join(fsdp_strategy.SUPPORTED_PRECISIONS)}")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from fsdp_strategy.tools.consolidate import consolidate_to_file as consolidate
    from fsdp_strategy.tools.export import export_safetensors
    from fsdp_strategy.tools.export_peft import export_peft

    try:
        if args.format == "peft":
            _refuse_options(args, "--max-shard-size", "--config-from", format="peft")
            summary = export_peft(
                args.checkpoint_dir,
                args.output_file,
                prefix=args.prefix,
                overwrite=args.overwrite,
                progress=args.progress,
                weights_only=args.weights_only,
            )
        elif args.format == "safetensors":
            summary: Any = export_safetensors(
                args.checkpoint_dir,
                args.output_file,
                prefix=args.prefix or "",
                max_shard_size=args.max_shard_size or "5GB",
                config_from=args.config_from,
                overwrite=args.overwrite,
                progress=args.progress,
                weights_only=args.weights_only,
            )
        else:
            _refuse_options(args, "--prefix", "--max-shard-size", "--config-from", format="lightning")
            summary = consolidate(
                args.checkpoint_dir,
                args.output_file,
                overwrite=args.overwrite,
                progress=args.progress,
                weights_only=args.weights_only,
            )
    except (
        ImportError,
        OSError,
        TypeError,
        ValueError,
    ) as exc:  # a missing, foreign or damaged checkpoint; an existing output; disk full
        message = " ".join(str(exc).split())
        print(f"fsdp-strategy consolidate: error: {message}", file=sys.stderr)
        return 2
    print(summary.describe())
    return 0


def _refuse_options(args: argparse.Namespace, *options: str, format: str) -> None:
    for option in options:
        value = getattr(args, option.removeprefix("--").replace("-", "_"))
        if value is not None:
            formats = "--format safetensors or peft" if option == "--prefix" else "--format safetensors"
            raise ValueError(f"{option} is an option of {formats}; got {value!r} with --format {format}")


def _estimate(args: argparse.Namespace) -> int:
    from fsdp_strategy.estimator.report import estimate
    from fsdp_strategy.sizes import parse_bytes

    try:
        report = estimate(
            args.target,
            init_args=parse_init_args(args.init_args),
            world_sizes=parse_world_sizes(args.world_sizes),
            precision=args.precision,
            optimizer=args.optimizer,
            budget=None if args.budget is None else parse_bytes(args.budget, option="--budget"),
            processes_per_node=args.processes_per_node,
            strategies=parse_strategies(args.strategies),
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            sample_batch=args.sample_batch,
            activation_checkpointing=_policy(args.activation_checkpointing),
            accumulate_grad_batches=args.accumulate_grad_batches,
            frozen_dtype=args.frozen_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except (TypeError, ValueError) as exc:  # a bad option, a class that cannot be imported or built
        print(f"fsdp-strategy estimate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())
    return 0


def _add_estimate_parser(commands: argparse._SubParsersAction) -> None:
    from fsdp_strategy.estimator.groups import ACCEPTED_PRECISIONS
    from fsdp_strategy.estimator.model_state import OPTIMIZERS, STRATEGIES

    parser = commands.add_parser(
        "estimate",
        help="memory per rank and communication per step of each strategy, before training",
        description="Builds the module on the meta device (no memory, no process group) and prints, per strategy and"
        " world size, the parameters, gradients and optimizer state each rank holds, the largest gathered unit, the"
        " peak, and the bytes all-gathered, reduce-scattered and all-reduced per optimizer step. With --batch-size and"
        " --seq-len (or --sample-batch) it runs one training_step and backward on fake tensors and the peak includes"
        " activations. With --budget it recommends the simplest setting that fits.",
    )
    parser.add_argument(
        "target",
        metavar="MODULE:Class",
        help="the LightningModule, e.g. examples.gpt:GPT; or a Hugging Face weights directory (model.safetensors or"
        " its index), whose parameters are read from the file headers",
    )
    parser.add_argument("--init-args", metavar="JSON", help="constructor arguments, a JSON object")
    parser.add_argument("--world-sizes", default="1,2,4,8", help="comma-separated numbers of ranks (default: 1,2,4,8)")
    parser.add_argument("--precision", default="32-true", choices=ACCEPTED_PRECISIONS, help="default: 32-true")
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="default: adamw")
    parser.add_argument(
        "--frozen-dtype",
        choices=("bfloat16", "float16"),
        help="the dtype frozen parameters are kept in (the strategy's frozen_dtype); default: as built",
    )
    parser.add_argument("--budget", help="memory per rank, e.g. 80GiB, 80GB, 512MiB or plain bytes")
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        metavar="B",
        help="samples per rank and forward (the Trainer's batch size): trace a training step for the"
        " peak with activations",
    )
    parser.add_argument(
        "--seq-len", type=_positive_int, metavar="T", help="the batch is (tokens, targets), two int64 tensors of B x T"
    )
    parser.add_argument(
        "--sample-batch",
        metavar="MODULE:function",
        help="instead of --seq-len: a function returning a batch of n samples",
    )
    parser.add_argument(
        "--activation-checkpointing",
        metavar="POLICY",
        help="also with activation checkpointing of these modules: comma-separated class names, or auto",
    )
    parser.add_argument(
        "--accumulate-grad-batches",
        type=_positive_int,
        default=1,
        metavar="N",
        help="micro-batches per optimizer step (default: 1)",
    )
    parser.add_argument(
        "--processes-per-node",
        type=_positive_int,
        metavar="N",
        help="fsdp2_hybrid's shard size (default: half the world size, i.e. 2 nodes)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="ranks that split each layer (the strategy's tensor_parallel_size), by the model's Hugging Face"
        " base_model_tp_plan; the tensor-parallel activation all-reduce needs --batch-size (default: 1)",
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all of them)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=_estimate)


def _policy(text: str | None) -> str | list[str] | None:
    """``"auto"`` as itself, ``"Block,Attention"`` as a list of class names."""
    if text is None or text == "auto":
        return text
    return [name.strip() for name in text.split(",") if name.strip()]


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int; got {text!r}")
    return int(text)


# --- the command line's text as the values the estimator and the benchmark take ------------------------------

_JSON_FORM = """a JSON object such as '{"n_layer": 12}'"""


def parse_world_sizes(text: str, *, option: str = "--world-sizes") -> list[int]:
    """``"1,2,4,8"`` as ``[1, 2, 4, 8]``."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(size <= 0 for size in sizes):
        raise ValueError(f"`{option}` must be comma-separated positive ints such as 1,2,4,8; got {text!r}.")
    return sizes


def parse_strategies(text: str, *, option: str = "--strategies") -> list[str]:
    """``"ddp,fsdp2"`` as ``["ddp", "fsdp2"]``, each one of the estimator's strategies."""
    from fsdp_strategy.estimator.model_state import STRATEGIES

    names = [part.strip() for part in text.split(",")]
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        raise ValueError(f"`{option}` must be comma-separated names from {', '.join(STRATEGIES)}; got {text!r}.")
    return names


def parse_init_args(text: str | None, *, option: str = "--init-args") -> dict[str, Any]:
    """A JSON object of constructor arguments (``None``: no arguments)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"`{option}` must be {_JSON_FORM}; got {text!r} ({exc}).") from exc
    if not isinstance(value, dict):
        raise ValueError(f"`{option}` must be {_JSON_FORM}; got {text!r}.")
    return value


def _benchmark(args: argparse.Namespace) -> int:
    from fsdp_strategy.tools.benchmark import run

    try:
        run.run_benchmark(
            model=args.model,
            init_args=None if args.init_args is None else parse_init_args(args.init_args),
            size=args.size,
            strategies=run.parse_strategies(args.strategies),
            world_sizes=parse_world_sizes(args.world_sizes),
            precision=args.precision,
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            vocab_size=args.vocab_size,
            baseline=args.baseline,
            out=args.out,
            progress=args.progress,
        )
    except (ImportError, TypeError, ValueError) as exc:  # a bad option or model, a missing extra
        print(f"fsdp-strategy benchmark: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a run failed; its output ends the message
        print(f"fsdp-strategy benchmark: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_benchmark_parser(commands: argparse._SubParsersAction) -> None:
    from fsdp_strategy.tools.benchmark.gpt import GPT_SIZES

    parser = commands.add_parser(
        "benchmark",
        help="train one model under several strategies and world sizes on CPU; compare memory and speed",
        description="Runs each (strategy, world size, repeat) as a fresh torchrun job on CPU (gloo, one thread per"
        " rank), repeats interleaved, and writes results.csv, results.json and plot.png to --out. Needs the"
        " 'benchmarks' extra: pip install 'fsdp-strategy[benchmarks]'.",
    )
    model = parser.add_argument_group("model (default: the example GPT, --size small)")
    model.add_argument(
        "--model",
        metavar="MODULE:Class",
        help="a LightningModule whose forward maps token ids (batch, seq) to logits (batch, seq, vocab)",
    )
    model.add_argument("--init-args", metavar="JSON", help="the --model's constructor arguments, a JSON object")
    model.add_argument(
        "--size", help=f"the example GPT's size: {', '.join(GPT_SIZES)} (0.12M, 11M, 25M, 116M parameters)"
    )
    parser.add_argument(
        "--strategies",
        default="ddp,fsdp2,fsdp2_grad_op,model_parallel,raw_fsdp2",
        help="comma-separated (default: all of them); fsdp2 and fsdp2_grad_op also as A/B variants:"
        " NAME:OPTION=VALUE (an FSDP2Strategy option, e.g. fsdp2:host_memory=keep) and"
        " NAME:init=meta (the model built in trainer.init_module(empty_init=True))",
    )
    parser.add_argument(
        "--baseline",
        metavar="STRATEGY",
        help="one of --strategies: also compare the others with it, round by round (memory and CPU time per step)",
    )
    parser.add_argument("--world-sizes", default="2", help="comma-separated numbers of CPU processes (default: 2)")
    parser.add_argument("--precision", default="32-true", help="32-true or bf16-mixed (default: 32-true)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (default: 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default: 5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration (default: 3)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step (default: 8)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    parser.add_argument("--vocab-size", type=int, default=256, help="token ids are drawn below this (default: 256)")
    parser.add_argument("--out", default="benchmark_results", help="output directory (default: benchmark_results)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.set_defaults(run=_benchmark)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-strategy", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("env", help="versions, devices and the registered strategy names").set_defaults(run=_env)
    consolidate = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint directory as one ordinary Lightning checkpoint file",
        description="Reads a sharded checkpoint (saved by FSDP2Strategy) in one process, tensor by tensor, and writes"
        " one Lightning checkpoint file that loads with any strategy or none, or (--format safetensors) the model's"
        " weights as Hugging Face safetensors that from_pretrained loads.",
    )
    consolidate.add_argument(
        "checkpoint_dir",
        metavar="CKPT",
        help="the sharded checkpoint (a directory or a URL such as"
        " s3://bucket/run/last.ckpt); with --format safetensors or peft also a checkpoint file",
    )
    consolidate.add_argument(
        "output_file", metavar="OUT", help="the checkpoint file to write (--format safetensors or peft: the folder)"
    )
    consolidate.add_argument(
        "--format",
        choices=("lightning", "safetensors", "peft"),
        default="lightning",
        help="lightning: one Lightning checkpoint file (default); safetensors: the model's weights"
        " as save_pretrained writes them, for from_pretrained; peft: a peft run's adapters (adapter_model.safetensors"
        " and adapter_config.json) as PeftModel.save_pretrained writes them, for PeftModel.from_pretrained, from any"
        " of its checkpoints (adapter, sharded or full)",
    )
    consolidate.add_argument(
        "--prefix",
        help="safetensors: keep the weights under this LightningModule attribute and"
        " strip it, e.g. 'model.' for self.model = AutoModelForCausalLM...; peft: the attribute of the peft model,"
        " needed only when the module holds several",
    )
    consolidate.add_argument(
        "--max-shard-size",
        help="safetensors: split into files of at most this size with an index"
        " file, as save_pretrained does (default: 5GB)",
    )
    consolidate.add_argument(
        "--config-from",
        metavar="PATH",
        help="safetensors: config.json (or a folder holding it) to"
        " write beside the weights; default: a config found in the checkpoint's hyper-parameters",
    )
    consolidate.add_argument("--overwrite", action="store_true", help="replace OUT_FILE if it exists")
    consolidate.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    consolidate.add_argument(
        "--no-weights-only",
        dest="weights_only",
        action="store_false",
        help="trust the checkpoint: read meta.pt and the other pickled entries with torch.load(weights_only=False),"
        " which runs code they name, as load_from_checkpoint(..., weights_only=False) does; needed for"
        " hyper-parameters that are your own classes (dataclasses, enums) or OmegaConf configs",
    )
    consolidate.set_defaults(run=_consolidate)
    _add_benchmark_parser(commands)
    _add_estimate_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
