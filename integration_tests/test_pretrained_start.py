"""Fine-tuning from pretrained weights starts from them: a tiny Llama built from its config in ``configure_model``,
plain or with peft's LoRA, ``init_weights`` a ``save_pretrained`` directory (one file, or an index of several),
built eagerly or under ``meta_init``, on a 1-D mesh of 2 ranks and on 2 data x 2 tensor ranks
(``tensor_parallel_size=2``). Right after setup its logits are those of ``from_pretrained`` in one process (with
peft's adapters on it), and every adapter not in the weights has peft's init (B zero) as that reference has; the
random ones (A) are split as they are on the 1-D mesh. One launch of ``integration_tests/pretrained_start_worker.py``
per mesh runs all eight cases."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from integration_tests.conftest import max_absolute_difference, torchrun
from integration_tests.pretrained_start_worker import CASES, LORA_RANK

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

# An embedding of 37 rows: shards 19/18 over the data-parallel ranks; heads and the MLP split evenly over 2.
CONFIG = {"vocab_size": 37}


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from testkit.hf import TINY_LLAMA

    root = tmp_path_factory.mktemp("pretrained_start")
    torch.manual_seed(11)
    source = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **CONFIG}))
    directories = {"file": root / "file", "index": root / "index"}
    source.save_pretrained(directories["file"])
    source.save_pretrained(directories["index"], max_shard_size="20KB")
    assert not (directories["file"] / "model.safetensors.index.json").exists()
    assert len(list(directories["index"].glob("*.safetensors"))) > 1
    return directories


def reference(directory: Path, model: str) -> dict:
    """``from_pretrained`` in this process, with peft's adapters for ``lora``: logits and adapters as it starts."""
    from testkit.hf import lora_model
    from testkit.models import token_loader

    torch.manual_seed(3)
    built = transformers.AutoModelForCausalLM.from_pretrained(directory)
    if model == "lora":
        built = lora_model(built, LORA_RANK)
    built.eval()
    tokens = next(iter(token_loader(batch_size=4, samples=8)))[0]
    with torch.no_grad():
        logits = built(input_ids=tokens).logits
    return {"logits": logits, "adapters": {n: p.detach() for n, p in built.named_parameters() if "lora_" in n}}


# (processes, tensor_parallel_size) of each mesh: 1-D over 2 ranks, 2 data x 2 tensor ranks.
MESHES = {"1-D": (2, 1), "2x2": (4, 2)}


@pytest.fixture(scope="module")
def launches(weights: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """Rank 0's results of the launch on a mesh of :data:`MESHES`, launched once for the tests that read them."""
    done: dict[str, dict] = {}

    def launch(mesh: str) -> dict:
        if mesh not in done:
            nproc, tensor_parallel_size = MESHES[mesh]
            workdir = tmp_path_factory.mktemp(mesh)
            out = workdir / "results.pt"
            args = ["--file", str(weights["file"]), "--index", str(weights["index"]), "--out", str(out)]
            args += ["--tensor-parallel-size", str(tensor_parallel_size)]
            torchrun("integration_tests.pretrained_start_worker", args, nproc=nproc, cwd=workdir)
            done[mesh] = torch.load(out)
        return done[mesh]

    return launch


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_case_starts_from_the_weights_and_peft_init_as_from_pretrained(
    weights: dict[str, Path], launches: Callable[[str], dict], mesh: str
) -> None:
    results = launches(mesh)
    assert sorted(results) == sorted(CASES)
    for case, result in results.items():
        _, model, kind = case.split("/")
        expected = reference(weights[kind], model)
        # peft's B is zero: any other value is another adapter, whatever the base.
        lora_b = {name: value for name, value in expected["adapters"].items() if "lora_B" in name}
        assert result["adapters"].keys() == expected["adapters"].keys(), case
        assert all(torch.equal(result["adapters"][name], value) for name, value in lora_b.items()), case
        # Tensor parallelism sums the rowwise layers' partial products in another order.
        torch.testing.assert_close(
            result["logits"],
            expected["logits"],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda message, case=case: f"{case}: {message}",
        )


def test_the_random_adapters_are_those_of_the_one_dimensional_run_when_split(launches: Callable[[str], dict]) -> None:
    # LoRA's A is random. Eagerly every rank draws the same stream; under meta_init each row has a stream of its own,
    # also in a shard that a rowwise split cuts by columns (o_proj's and down_proj's A): the split changes no value.
    one_dimensional, split = launches("1-D"), launches("2x2")
    for case in (case for case in CASES if "/lora/" in case):
        assert max_absolute_difference(split[case]["adapters"], one_dimensional[case]["adapters"]) == 0.0, case
