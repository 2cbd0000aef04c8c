"""Length distributions for the benchmarks: real OpenChat V1 SFT lengths and a short-document SFT mix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

OPENCHAT_CAP = 2048  # the OpenChat lengths are capped at 2,048 tokens
ENV = "MEGAPACK_LENGTHS"


def _candidates() -> list[Path]:
    name = Path("data") / "openchat_v1_lengths.json"
    repo = Path(__file__).resolve().parents[2]
    return [
        Path.cwd() / ".." / "shared" / name,
        repo / ".." / "shared" / name,
        Path.cwd() / "shared" / name,
    ]


def load_lengths(path: str | None = None) -> tuple[list[int], str]:
    """(lengths, where they came from): ``path``, $MEGAPACK_LENGTHS, or ../shared/data/openchat_v1_lengths.json.

    Falls back to 6,144 synthetic lognormal lengths capped at 2,048 (and says so) when no file is found.
    """
    explicit = path or os.environ.get(ENV)
    candidates = [Path(explicit)] if explicit else _candidates()
    for candidate in candidates:
        if candidate.is_file():
            values = json.loads(candidate.read_text())
            if not isinstance(values, list) or not all(
                isinstance(v, int) and v > 0 for v in values
            ):
                raise ValueError(f"{candidate}: expected a JSON list of positive ints")
            return values, f"{candidate.resolve()} ({len(values):,} lengths)"
    if explicit:
        raise FileNotFoundError(f"lengths file {explicit} not found")
    rng = np.random.default_rng(0)
    synthetic = np.clip(rng.lognormal(7.0, 0.9, 6144), 24, OPENCHAT_CAP).astype(int).tolist()
    return synthetic, "synthetic lognormal stand-in (openchat_v1_lengths.json not found)"


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
