"""Known-harmless megatron-core warnings, filtered wherever megapack imports megatron-core (lazily).

Without Apex or Transformer Engine, megatron-core warns once per process per module that the
optional fused kernels are absent (4 UserWarnings for ``megatron.core``, more for a GPT model's
modules, and as many again in every worker process) and then uses its torch fallbacks: exactly what
megapack expects on CPU. megatron-core 0.19 also imports ``hyper_comm_grid`` on megapack's
paths, which warns that ``absl`` is absent and logs through the standard ``logging`` instead.
megatron-core 0.16's ``TransformerConfig`` warns that its own default ``cuda_graph_scope="full"``
is deprecated (0.19's default is None), and on CPU the linear layers recommend
``CUDA_DEVICE_MAX_CONNECTIONS=1``, a CUDA stream setting with no meaning there. Every megapack
import or run of megatron code goes through `quiet_megatron`, which ignores only the messages in
`HARMLESS` (the CUDA hint only when CUDA is absent) and only when megatron's own modules raise
them; every other warning stays visible.

Example:
    >>> with quiet_megatron():  # doctest: +SKIP
    ...     from megatron.core import parallel_state  # no "Apex is not installed" lines
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

HARMLESS: tuple[tuple[str, str], ...] = (
    (
        r"Transformer Engine and Apex are not installed",
        "optional fused optimizer/norm kernels; megatron-core falls back to torch's",
    ),
    (r"Apex is not installed", "optional fused norm; megatron-core falls back to torch's"),
    (
        r"full scope is deprecated",
        "TransformerConfig's own default cuda_graph_scope='full' (megatron-core 0.16); megapack "
        "captures no CUDA graphs through it",
    ),
    (
        r"absl\.logging is not installed",
        "hyper_comm_grid (imported on megapack's paths from megatron-core 0.19) logs through the "
        "standard logging module instead",
    ),
)
"""(message regex, why it is harmless) of the warnings `quiet_megatron` always ignores."""

HARMLESS_WITHOUT_CUDA: tuple[tuple[str, str], ...] = (
    (
        r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
        r"environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        "a CUDA stream setting; meaningless on CPU, kept visible where CUDA is available",
    ),
)
"""Ignored only when CUDA is not available."""

MEGATRON_MODULES = r"megatron(\.|$)"
"""Only warnings raised by megatron's own modules are filtered (``warnings`` matches the module)."""


@contextmanager
def quiet_megatron() -> Iterator[None]:
    """Within this block, ignore megatron-core's known-harmless UserWarnings; restore filters after."""
    import torch

    harmless = HARMLESS if torch.cuda.is_available() else HARMLESS + HARMLESS_WITHOUT_CUDA
    with warnings.catch_warnings():
        for message, _why in harmless:
            warnings.filterwarnings(
                "ignore", message=message, category=UserWarning, module=MEGATRON_MODULES
            )
        yield
