"""Context-parallel padding benchmark: what each CP layout costs in padding and rows.

The "document" layout (Transformer Engine's fused THD CP attention) needs every document padded
to a multiple of 2 * cp; rows are then planned on the padded lengths (`PackOptions(cp_size=...)`,
as `PackedDataset` and ``megapack pack`` do). The "row" layout (Megatron-LM's per-sequence balancing)
needs only the row length to divide by 2 * cp, which any seq_len of a power of two does: no
padding beyond packing. Reported per layout and cp: padding tokens (and their share of the real
tokens), rows (BFD), and efficiency = real tokens / (rows x seq_len), next to plain packing (cp 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

CP_SIZES = (2, 4, 8)


def run_cp_padding(
    lengths: Sequence[int], seq_len: int, cps: Sequence[int] = CP_SIZES
) -> list[dict[str, Any]]:
    """One row for plain packing (layout "none", cp 1), then one per layout and cp."""
    from megapack.packing import PackOptions, plan

    real = np.asarray(lengths, dtype=np.int64)
    total = int(real.sum())
    base = plan(real, seq_len, algorithm="bfd").num_bins
    rows = [_row("none", 1, 0, base, total, seq_len, base)]
    for cp in cps:
        if seq_len % (2 * cp):
            raise ValueError(f"seq_len={seq_len} is not a multiple of 2*cp={2 * cp}")
        padded = plan(real, PackOptions(seq_len=seq_len, cp_size=cp))  # "document" layout
        rows.append(
            _row("document", cp, padded.padding_tokens, padded.num_bins, total, seq_len, base)
        )
        rows.append(_row("row", cp, 0, base, total, seq_len, base))
    return rows


def _row(
    layout: str, cp: int, padding: int, bins: int, total: int, seq_len: int, base: int
) -> dict[str, Any]:
    return {
        "layout": layout,
        "cp": cp,
        "seq_len": seq_len,
        "padding_tokens": padding,
        "padding_share": padding / total,
        "rows": bins,
        "rows_vs_cp1": bins / base,
        "efficiency": total / (bins * seq_len),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The section's markdown table."""
    lines = [
        "## Context parallelism: padding each CP layout costs",
        "",
        "| layout | cp | padding tokens | padding / real tokens | rows | rows vs cp 1 | efficiency |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['cp']} | {r['padding_tokens']:,} | {r['padding_share']:.2%} | "
            f"{r['rows']:,} | {r['rows_vs_cp1']:.3f} | {r['efficiency']:.2%} |"
        )
    return "\n".join(lines) + "\n"
