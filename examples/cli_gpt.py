"""The GPT example as a LightningCLI: the strategy is one flag, or one block of a YAML file.

Run from the repository root (with the package installed, e.g. ``pip install -e .``):

    # FSDP2 with the settings in the YAML file (2 CPU processes, bf16-mixed)
    python examples/cli_gpt.py fit --config examples/config_fsdp2.yaml

    # the same run with DDP: one flag changes the strategy
    python examples/cli_gpt.py fit --config examples/config_fsdp2.yaml --trainer.strategy=ddp

    # without a config file: any registered strategy name works
    python examples/cli_gpt.py fit --trainer.strategy=ddp --trainer.max_steps=5 --trainer.accelerator=cpu --trainer.devices=2
    python examples/cli_gpt.py fit --trainer.strategy=fsdp2 --trainer.max_steps=5 --trainer.accelerator=cpu --trainer.devices=2

    # FSDP2Strategy options from the command line instead of the YAML file
    python examples/cli_gpt.py fit --trainer.strategy=fsdp_strategy.FSDP2Strategy \\
        --trainer.strategy.reshard_after_forward=false --trainer.max_steps=5 --trainer.accelerator=cpu --trainer.devices=2

    # every option of the model, the data and the strategy
    python examples/cli_gpt.py fit --help
    python examples/cli_gpt.py fit --trainer.strategy.help fsdp_strategy.FSDP2Strategy

On GPUs add ``--trainer.accelerator=gpu --trainer.devices=-1``. The data's ``block_size`` is also the model's
(set it with ``--data.block_size``).
"""

from gpt import GPT, ByteTextDataModule
from lightning.pytorch.cli import LightningCLI

import fsdp_strategy  # noqa: F401  (registers the "fsdp2*" strategy names)


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.block_size", "model.block_size")


def main() -> None:
    GPTCLI(GPT, ByteTextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
