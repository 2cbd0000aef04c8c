"""Deprecated path: `python -m megapack.bench.gpu_report` runs `megapack.bench.gpu.report`, the GPU kit's new home."""

import sys
import warnings

from megapack.bench.gpu.report import main

if __name__ == "__main__":
    warnings.warn(
        "megapack.bench.gpu_report moved to megapack.bench.gpu.report",
        DeprecationWarning,
        stacklevel=1,
    )
    sys.exit(main())
