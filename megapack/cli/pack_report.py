"""What the ``megapack`` command prints: counts with the right plural, `megapack pack`'s report,
the tokenizer used, and the documents longer than ``--seq-len`` with a length that cuts fewer.

Kept apart from `megapack.cli` (argument parsing and the commands) so both stay short; it imports
nothing heavy (numpy only inside the functions that need it), so ``megapack --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

COVERAGES = (0.95, 0.99)
"""The shares of documents a suggested ``--seq-len`` holds whole (`seq_len_advice`)."""
ROUND_TO = 128
"""A suggested ``--seq-len`` is rounded up to a multiple of this (and of the padding multiple):
the tile of attention kernels, and of the sequence lengths Megatron runs are given."""
CUTS = {"split": "split", "truncate": "truncate", "drop": "drop", "error": "refuse"}
"""What each ``--long-docs`` policy does to a document longer than ``--seq-len``, as a verb."""


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


def pack_report(
    meta: dict[str, Any],
    source: str,
    skipped_note: str = "",
    lengths: np.ndarray | None = None,
    multiple: int = 1,
) -> list[str]:
    """What `megapack pack` did: inputs, the tokenizer, long documents split / truncated /
    dropped (with a ``--seq-len`` that would cut fewer: `seq_len_advice` of the input documents'
    ``lengths``, ``multiple`` the padding multiple), rows.

    Example:
        >>> meta = {"input_documents": 300, "documents": 2213, "split_documents": 290,
        ...         "packing": {"seq_len": 64}, "truncated_documents": 0, "truncated_tokens": 0,
        ...         "dropped_documents": 0, "dropped_tokens": 0, "rows": 1, "efficiency": 0.93,
        ...         "lower_bound": 1, "tokenizer": "megapack.data.ByteTokenizer",
        ...         "vocab_size": 259, "eos_id": 257}
        >>> print("\\n".join(pack_report(meta, "sft.jsonl")))
        read 300 documents from sft.jsonl
        tokenizer: megapack.data.ByteTokenizer, vocab 259 (the built-in byte tokenizer: --tokenizer DIR packs with your model's)
        290 of 300 documents longer than --seq-len 64: split into pieces (2,213 pieces packed in all)
        packed into 1 row of 64 tokens: 93.00% efficiency (lower bound 1 row)
    """
    m, seq_len = meta, int(meta["packing"]["seq_len"])
    inputs = int(m.get("input_documents", m["documents"]))
    lines = [
        f"read {plural(inputs, 'document')} from {source}"
        + (f"; {skipped_note}" if skipped_note else ""),
        tokenizer_line(m),
    ]
    documents = "document" if inputs == 1 else "documents"
    longer = f"of {inputs:,} {documents} longer than --seq-len {seq_len:,}"
    policy = str(m["packing"].get("long_docs", "split"))
    cut = 0
    if m.get("split_documents"):
        cut = int(m["split_documents"])
        lines.append(
            f"{cut:,} {longer}: split into pieces "
            f"({plural(int(m['documents']), 'piece')} packed in all)"
        )
    if m.get("truncated_documents"):
        cut = int(m["truncated_documents"])
        lines.append(
            f"{cut:,} {longer}: truncated ({plural(int(m['truncated_tokens']), 'token')} lost)"
        )
    if m.get("dropped_documents"):
        cut = int(m["dropped_documents"])
        lines.append(
            f"{cut:,} {longer}: dropped ({plural(int(m['dropped_tokens']), 'token')} lost)"
        )
    if cut and lengths is not None:
        lines += seq_len_advice(lengths, seq_len, multiple=multiple, policy=policy)
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


def tokenizer_line(tokenized: Mapping[str, Any]) -> str:
    """Which tokenizer made the tokens, and its vocabulary size, as ``meta.json`` records them
    (``tokenizer``, ``vocab_size``, ``eos_id``; the tokenizer None for token ids read as they are).

    Example:
        >>> tokenizer_line({"tokenizer": "tok/", "vocab_size": 32000, "eos_id": 2})
        'tokenizer: tok/, vocab 32,000 (eos id 2)'
        >>> tokenizer_line({"tokenizer": None, "vocab_size": None, "eos_id": None})
        'tokenizer: none, token ids read as they are (vocab unknown)'
    """
    name, vocab, eos = (
        tokenized.get("tokenizer"),
        tokenized.get("vocab_size"),
        tokenized.get("eos_id"),
    )
    if name is None:
        split = f"; documents end at --eos-id {eos}" if eos is not None else ""
        return f"tokenizer: none, token ids read as they are (vocab unknown{split})"
    line = f"tokenizer: {name}, vocab {int(vocab):,}" if vocab is not None else f"tokenizer: {name}"
    if name == "megapack.data.ByteTokenizer":
        return line + " (the built-in byte tokenizer: --tokenizer DIR packs with your model's)"
    return line + (f" (eos id {eos})" if eos is not None else "")


def covering_seq_lens(lengths: np.ndarray, *, multiple: int = 1) -> dict[float, int]:
    """For each share of `COVERAGES`, the ``--seq-len`` that holds that share of the documents
    (their ``lengths``) whole: the share's length, rounded up to a multiple of `ROUND_TO` (and of
    the padding ``multiple``).

    Example:
        >>> import numpy as np
        >>> covering_seq_lens(np.concatenate([np.arange(100, 400), [2000] * 5]))
        {0.95: 512, 0.99: 2048}
    """
    import math

    import numpy as np

    step = math.lcm(ROUND_TO, max(1, int(multiple)))
    out = {}
    for share in COVERAGES:
        fits = int(np.quantile(lengths, share, method="higher"))  # a document's length
        out[share] = -(-fits // step) * step
    return out


def seq_len_advice(
    lengths: np.ndarray, seq_len: int, *, multiple: int = 1, policy: str = "split"
) -> list[str]:
    """A ``--seq-len`` that would cut far fewer of the documents (their ``lengths`` in tokens):
    `covering_seq_lens` where above ``seq_len``, each with how many documents it would still
    cut (``policy``: what ``--long-docs`` does to them); nothing when ``seq_len`` already holds
    99% of them.

    Example: 300 documents of 100, 101, ..., 399 tokens and 5 of 2,000 at ``--seq-len 256``
    (149 cut): 95% hold at most 389 tokens (rounded up: 512, which cuts the 5 long ones), 99%
    at most 2,000 (2,048, which cuts none):

        >>> import numpy as np
        >>> lengths = np.concatenate([np.arange(100, 400), [2000] * 5])
        >>> print(seq_len_advice(lengths, 256)[0])  # doctest: +NORMALIZE_WHITESPACE
          fewer cut: --seq-len 512 would split 5 (95% of the documents fit whole), --seq-len
          2,048 would split 0 (99%): each the length covering that share, rounded up to a
          multiple of 128
    """
    import math

    import numpy as np

    suggested: dict[int, list[float]] = {}  # length -> the shares it holds whole
    for share, length in covering_seq_lens(lengths, multiple=multiple).items():
        if length > seq_len:
            suggested.setdefault(length, []).append(share)
    parts: list[str] = []
    for length, shares in suggested.items():
        held = " and ".join(f"{share:.0%}" for share in shares)
        held += "" if parts else " of the documents fit whole"
        cut = int((np.asarray(lengths) > length).sum())
        parts.append(f"--seq-len {length:,} would {CUTS.get(policy, policy)} {cut:,} ({held})")
    if not parts:
        return []
    step = math.lcm(ROUND_TO, max(1, int(multiple)))
    return [
        f"  fewer cut: {', '.join(parts)}: each the length covering that share, rounded up to a "
        f"multiple of {step}"
    ]
