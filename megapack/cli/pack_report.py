"""What the ``megapack`` command prints: counts with the right plural, and `megapack pack`'s report.

Kept apart from `megapack.cli` (argument parsing and the commands) so both stay short; it imports
nothing heavy, so ``megapack --help`` stays fast.
"""

from __future__ import annotations

from typing import Any


def plural(count: int, word: str, words: str | None = None) -> str:
    """``"1 row"``, ``"2,048 rows"``: the count with thousands separators and the right form."""
    return f"{count:,} {word if count == 1 else (words or word + 's')}"


def no_documents(reader: Any) -> str:
    """Why an input gave no documents, for the one-line error that names it.

    Example:
        >>> no_documents(None)
        'no documents in it'
    """
    stats = getattr(reader, "stats", None)
    if stats is not None and stats.skipped:
        return (
            f"no documents in it ({plural(stats.skipped, 'bad line')} skipped "
            f"{dict(stats.skipped_by_problem)})"
        )
    return "no documents in it"


def pack_report(meta: dict[str, Any], source: str, skipped_note: str = "") -> list[str]:
    """What `megapack pack` did: inputs, long documents split / truncated / dropped, rows.

    Example:
        >>> meta = {"input_documents": 300, "documents": 2213, "split_documents": 290,
        ...         "packing": {"seq_len": 64}, "truncated_documents": 0, "truncated_tokens": 0,
        ...         "dropped_documents": 0, "dropped_tokens": 0, "rows": 1, "efficiency": 0.93,
        ...         "lower_bound": 1}
        >>> print("\\n".join(pack_report(meta, "sft.jsonl")))
        read 300 documents from sft.jsonl
        290 documents longer than 64 tokens: split into pieces (2,213 pieces packed in all)
        packed into 1 row of 64 tokens: 93.00% efficiency (lower bound 1 row)
    """
    m, seq_len = meta, int(meta["packing"]["seq_len"])
    inputs = int(m.get("input_documents", m["documents"]))
    lines = [
        f"read {plural(inputs, 'document')} from {source}"
        + (f"; {skipped_note}" if skipped_note else "")
    ]
    longer = f"longer than {plural(seq_len, 'token')}"
    if m.get("split_documents"):
        lines.append(
            f"{plural(int(m['split_documents']), 'document')} {longer}: split into pieces "
            f"({plural(int(m['documents']), 'piece')} packed in all)"
        )
    if m.get("truncated_documents"):
        lines.append(
            f"{plural(int(m['truncated_documents']), 'document')} {longer}: truncated "
            f"({plural(int(m['truncated_tokens']), 'token')} lost)"
        )
    if m.get("dropped_documents"):
        lines.append(
            f"{plural(int(m['dropped_documents']), 'document')} {longer}: dropped "
            f"({plural(int(m['dropped_tokens']), 'token')} lost)"
        )
    lines.append(
        f"packed into {plural(int(m['rows']), 'row')} of {seq_len:,} tokens: "
        f"{m['efficiency']:.2%} efficiency (lower bound {plural(int(m['lower_bound']), 'row')})"
        + (
            f"; {plural(int(m['padding_tokens']), 'alignment padding token')}"
            if m.get("padding_tokens")
            else ""
        )
    )
    return lines
