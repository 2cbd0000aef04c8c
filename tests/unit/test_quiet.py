"""`quiet_megatron` hides megatron-core's known-harmless warnings and nothing else."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from megapack.core.quiet import quiet_megatron


def emitted(message: str, module: str, category: type[Warning] = UserWarning) -> list[str]:
    """Messages that reach the user when ``module`` warns ``message`` inside `quiet_megatron`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_megatron():
            warnings.warn_explicit(message, category, f"{module}.py", 1, module=module)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "message",
    [
        "Apex is not installed. Falling back to Torch Norm",
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
        "absl.logging is not installed. Using logging.getLogger(__name__) instead. Please install "
        "absl.logging with `pip install absl-py` to use absl.logging.",  # megatron-core 0.19
    ],
)
def test_known_harmless_megatron_warnings_are_hidden(message: str) -> None:
    assert emitted(message, "megatron.core.models.backends") == []


def test_other_warnings_stay_visible() -> None:
    real = "tensor_model_parallel_size does not divide the number of attention heads"
    assert emitted(real, "megatron.core.transformer") == [real]  # megatron's real warnings
    apex = "Apex is not installed. Falling back to Torch Norm"
    assert emitted(apex, "mylib.norms") == [apex]  # the same text from someone else's module
    assert emitted(apex, "megatron.core.x", DeprecationWarning) == [apex]  # another category
    with warnings.catch_warnings(
        record=True
    ) as caught:  # and after the block, filters are restored
        warnings.simplefilter("always")
        with quiet_megatron():
            pass
        warnings.warn_explicit(apex, UserWarning, "b.py", 1, module="megatron.core.b")
    assert [str(w.message) for w in caught] == [apex]


def test_megapack_paths_into_megatron_print_no_warnings() -> None:
    """A fresh process, warnings on: megapack's megatron imports and a GPT build print nothing."""
    code = (
        "import torch, megapack\n"
        "from megapack.core.batch import make_packed_seq_params\n"
        "from megapack.megatron import packed_gpt_layer_spec\n"
        "make_packed_seq_params(torch.tensor([0, 3], dtype=torch.int32), None, 3)\n"
        "packed_gpt_layer_spec()\n"
        "from megatron.core.transformer import TransformerConfig\n"
        "from megapack.core.quiet import quiet_megatron\n"
        "with quiet_megatron():\n"
        "    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "default::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "ok\n"
    assert "Warning" not in done.stderr, done.stderr[-3000:]
