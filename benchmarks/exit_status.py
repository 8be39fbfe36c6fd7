"""Do finished 2-rank CPU fits exit with status 0? Launches a plain user script many times, as a job scheduler would.

    python benchmarks/exit_status.py --launches 30            # 30 with Lightning's launcher, 30 with torchrun
    python benchmarks/exit_status.py --launches 5 --launcher torchrun

The script is what a user writes: a ``Trainer(strategy="fsdp2", devices=2)`` fit of a tiny model, a checkpoint,
then the end of the file: no ``os._exit``, no ``destroy_process_group``. For every launch it records the exit status
of the launch (torchrun reports a rank's abort as its own failure; Lightning's launcher as rank 0's status, and the
rank-1 child's status is printed by the script's rank 0) and, for a failure, the last lines of its output. Prints
one line per launcher: launches, failures, and the distinct failure signatures.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import lightning as L
    import fsdp_strategy
    from testkit.models import TinyLM, token_loader

    if __name__ == "__main__":
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", max_steps=4, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=".")
        trainer.fit(TinyLM(), token_loader(samples=32), token_loader(samples=8))
        trainer.save_checkpoint("last.ckpt")
        print(f"rank {trainer.global_rank} done", flush=True)
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(launcher: str, workdir: Path) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "script.py"]
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        command = [sys.executable, "script.py"]
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def signature(output: str) -> str:
    for needle in ("terminate called", "Segmentation fault", "Traceback", "exitcode"):
        for line in output.splitlines():
            if needle in line:
                return line.strip()[:160]
    return output.strip().splitlines()[-1][:160] if output.strip() else "(no output)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=30)
    parser.add_argument("--launcher", choices=("lightning", "torchrun", "both"), default="both")
    args = parser.parse_args()
    launchers = ("lightning", "torchrun") if args.launcher == "both" else (args.launcher,)
    for launcher in launchers:
        failures: collections.Counter[str] = collections.Counter()
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            (workdir / "script.py").write_text(SCRIPT)
            for _ in range(args.launches):
                code, output = launch(launcher, workdir)
                both_done = output.count(" done") >= 2
                # A rank-1 child of Lightning's launcher that aborts after rank 0 exited shows only in the output.
                if code != 0 or not both_done or "terminate called" in output:
                    failures[f"status {code}: {signature(output)}"] += 1
        print(
            f"{launcher}: {args.launches} launches, {sum(failures.values())} not ending with status 0 on every rank"
            + "".join(f"\n  {count} x {what}" for what, count in failures.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
