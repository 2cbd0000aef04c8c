"""Each accelerator's bf16 dense peak, the denominator of MFU as the field defines it.

MFU = model FLOPs per second / the device's peak (PaLM's definition; Megatron-LM and torchtitan
report it the same way). The peaks are the vendors' datasheet figures for dense bf16 tensor-core
math, without structured sparsity, looked up by ``torch.cuda.get_device_name()``:

    device                      bf16 dense TFLOP/s
    H100 SXM (HBM3)             989
    H100 NVL                    835
    H100 PCIe                   756
    H200 (SXM, NVL)             989
    GH200                       989
    A100 (SXM, PCIe)            312
    B200                        2,250
    B100                        1,750

A name that matches none of them gives None: the report then says "unknown device" and prints no
MFU rather than guess.

Example:
    >>> peak_bf16_flops("NVIDIA H100 80GB HBM3")
    (989000000000000.0, 'H100 SXM')
    >>> peak_bf16_flops("NVIDIA H100 PCIe"), peak_bf16_flops("cpu (x86_64, 2 cores)")
    ((756000000000000.0, 'H100 PCIe'), (None, 'unknown device'))
"""

from __future__ import annotations

PEAKS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("GH200",), "GH200", 989e12),
    (("H100", "NVL"), "H100 NVL", 835e12),
    (("H100", "PCIE"), "H100 PCIe", 756e12),
    (("H100",), "H100 SXM", 989e12),
    (("H200",), "H200", 989e12),
    (("A100",), "A100", 312e12),
    (("B200",), "B200", 2250e12),
    (("B100",), "B100", 1750e12),
)
"""(words all in the device name, in order of precedence; the name reported; bf16 dense FLOP/s)."""


def peak_bf16_flops(device_name: str) -> tuple[float | None, str]:
    """(bf16 dense peak FLOP/s, the device as the table names it), or (None, "unknown device")."""
    upper = device_name.upper()
    for words, name, peak in PEAKS:
        if all(w in upper for w in words):
            return peak, name
    return None, "unknown device"


def cudnn_versions() -> dict[str, str]:
    """The cuDNN library torch runs with and the cuDNN frontend's Python package, for the report's
    header: ``{"cudnn": "9.19.0 (91900)", "cudnn_frontend": "1.28.0"}``; "none" where torch has no
    cuDNN, "not installed" where ``import cudnn`` (pip ``nvidia-cudnn-frontend``) finds nothing, and
    "import failed: <why>" where it is there but does not load.

    Example:
        >>> sorted(cudnn_versions())
        ['cudnn', 'cudnn_frontend']
    """
    import importlib
    import importlib.util

    import torch

    try:
        raw = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception as exc:  # a broken cuDNN install must not stop the kit's header
        raw, library = None, f"unreadable: {type(exc).__name__}: {exc}"
    else:
        library = "none" if raw is None else f"{_cudnn_release(int(raw))} ({raw})"
    try:
        found = importlib.util.find_spec("cudnn") is not None
    except (ImportError, ValueError):
        found = False
    frontend = "not installed"
    if found:
        try:
            frontend = str(getattr(importlib.import_module("cudnn"), "__version__", "unknown"))
        except Exception as exc:
            frontend = f"import failed: {type(exc).__name__}: {exc}"
    return {"cudnn": library, "cudnn_frontend": frontend}


def _cudnn_release(raw: int) -> str:
    """cuDNN's version number as a release: 91900 -> "9.19.0" (9.x: major x 10,000 + minor x 100
    + patch), 8907 -> "8.9.7" (8.x: major x 1,000 + minor x 100 + patch).

    Example:
        >>> _cudnn_release(91900), _cudnn_release(8907)
        ('9.19.0', '8.9.7')
    """
    if raw >= 90000:
        return f"{raw // 10000}.{raw % 10000 // 100}.{raw % 100}"
    return f"{raw // 1000}.{raw % 1000 // 100}.{raw % 100}"
