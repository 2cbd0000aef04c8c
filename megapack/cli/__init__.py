"""The ``megapack`` command line (`megapack.cli.main`): ``pack``, ``stats`` and ``bench``.

    megapack pack train.jsonl --seq-len 4096 --out packed/        # then PackedDataset.load("packed/")
    megapack stats train.jsonl --seq-len 4096 --plot lengths.png  # histogram, bound, every algorithm
    megapack bench --quick --json bench.json --plots plots/      # see megapack.bench

``--help`` never imports torch.
"""

from megapack.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
