"""Length distributions for the benchmarks: real OpenChat V1 SFT lengths and a short-document SFT mix.

The OpenChat lengths ship with megapack as package data (``megapack/bench/data/``, see its README for
the source and the figures other packers reach on them), so a fresh clone or an installed wheel
benchmarks on the real distribution with nothing beside it.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import numpy as np

OPENCHAT_CAP = 2048  # the OpenChat lengths are capped at 2,048 tokens
OPENCHAT_FILE = "openchat_v1_lengths.json"
ENV = "MEGAPACK_LENGTHS"


def bundled_lengths_path() -> Path:
    """Path of the OpenChat V1 lengths bundled with megapack (``megapack/bench/data/``)."""
    return Path(str(resources.files("megapack.bench") / "data" / OPENCHAT_FILE))


def load_lengths(path: str | os.PathLike[str] | None = None) -> tuple[list[int], str]:
    """(lengths, where they came from): ``path``, else $MEGAPACK_LENGTHS, else the bundled OpenChat V1 lengths.

    Args:
        path: a JSON list of positive ints; None for $MEGAPACK_LENGTHS or the bundled file.

    Returns:
        The lengths and a label naming the file and how many lengths it held.

    Raises:
        FileNotFoundError: the file named by ``path`` or $MEGAPACK_LENGTHS does not exist.
        ValueError: the file is not a non-empty JSON list of positive ints.

    Example:
        >>> lengths, source = load_lengths()
        >>> len(lengths), max(lengths), source.endswith("(6,144 lengths)")
        (6144, 2048, True)
    """
    explicit = path or os.environ.get(ENV)
    candidate = Path(explicit) if explicit else bundled_lengths_path()
    if not candidate.is_file():
        where = "--lengths" if path else f"${ENV}"
        raise FileNotFoundError(f"lengths file {str(explicit)!r} (from {where}) not found")
    values = json.loads(candidate.read_text())
    if (
        not isinstance(values, list)
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)
    ):
        raise ValueError(
            f"{candidate}: expected a non-empty JSON list of positive ints, e.g. [512, 2048, 37]"
        )
    return values, f"{candidate.resolve()} ({len(values):,} lengths)"


def throughput_datasets(
    lengths: list[int], seq_len: int, n_docs: int, seed: int = 0
) -> dict[str, list[int]]:
    """``n_docs`` lengths from each distribution, scaled from OpenChat's 2,048 cap to ``seq_len``.

    * ``openchat``: a random sample of the real lengths (half of them sit at the cap);
    * ``sft-short``: lognormal, median ~seq_len/14, like short instruction data.
    """
    rng = np.random.default_rng(seed)
    sample = rng.choice(np.asarray(lengths), size=n_docs, replace=len(lengths) < n_docs)
    scaled = np.maximum(
        1, np.round(np.minimum(sample, OPENCHAT_CAP) * seq_len / OPENCHAT_CAP)
    ).astype(int)
    short = np.clip(rng.lognormal(np.log(seq_len / 14), 0.8, n_docs), 4, seq_len).astype(int)
    return {"openchat": scaled.tolist(), "sft-short": short.tolist()}
