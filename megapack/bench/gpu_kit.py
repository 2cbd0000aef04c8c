"""Deprecated path: `python -m megapack.bench.gpu_kit` runs `megapack.bench.gpu.kit`, the GPU kit's new home."""

import sys
import warnings

from megapack.bench.gpu.kit import main

if __name__ == "__main__":
    warnings.warn(
        "megapack.bench.gpu_kit moved to megapack.bench.gpu.kit", DeprecationWarning, stacklevel=1
    )
    sys.exit(main())
