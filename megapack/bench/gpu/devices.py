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
