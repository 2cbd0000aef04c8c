"""The flags of ``megapack pack`` and ``stats``: checked in their own terms, then made into options.

Every number a command takes is checked first, before any input is read, and an error names the
flag as the user typed it (``--seq-len 100 must be a multiple of 8 (--pad-multiple 8)``). Then
`packing_from` builds the command's `PackOptions` from the flags (their defaults are the options'
own defaults, `megapack.packing.options.default_of`), so a flag and its option cannot drift. The
one search budget, ``--search-steps``, is `PackOptions.search_steps` (steps of the "best" search,
the same plan on every machine); ``stats`` once took ``--time-limit SECONDS`` instead.

Nothing here imports torch: ``megapack --help`` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from megapack.packing.names import ALGORITHMS, LONG_DOC_POLICIES
from megapack.packing.options import PackOptions, default_of

PACK_FLAGS: dict[str, tuple[tuple[str, ...], int | None, dict[str, Any]]] = {
    "cp_size": (
        ("--cp-size",),
        1,
        {
            "type": int,
            "help": "context-parallel size: pad documents to multiples of 2 x cp (with "
            "--pad-multiple: their lcm)",
        },
    ),
    "pad_to_multiple_of": (
        ("--pad-multiple", "--pad-to-multiple-of"),
        1,
        {
            "type": int,
            "help": "pad every document to a multiple of this (e.g. 8/16 for FP8 kernels); "
            "--seq-len must be a multiple of it",
        },
    ),
    "search_steps": (
        ("--search-steps",),
        0,
        {
            "type": int,
            "metavar": "STEPS",
            "help": "budget of the 'best' search, in steps (about 3,300 a second on OpenChat V1 "
            "on a 2-core CPU): the same rows on every machine",
        },
    ),
    "seed": (
        ("--seed",),
        0,
        {"type": int, "help": "seeds the packer and the per-epoch row shuffle"},
    ),
    "algorithm": (
        ("--algorithm",),
        None,
        {
            "choices": ALGORITHMS,
            "help": "bin-packing algorithm: best-fit / first-fit decreasing, first-fit, next-fit "
            "(streaming concat), or best (a search from bfd that never uses more rows)",
        },
    ),
    "long_docs": (
        ("--long-docs",),
        None,
        {
            "choices": LONG_DOC_POLICIES,
            "help": "documents longer than --seq-len: split them (chat at message boundaries), "
            "keep their first --seq-len tokens, drop them, or stop with an error",
        },
    ),
    "max_documents": (
        ("--max-documents",),
        1,
        {
            "type": int,
            "metavar": "N",
            "help": "at most N documents (or pieces) a row, for static shapes a CUDA graph "
            "replays (megapack stats suggests N)",
        },
    ),
}
"""The flag of each `PackOptions` field a command sets (besides the required ``--seq-len``): its
names, the least value `check_flags` accepts (None: a choice), and argparse keywords; the default
is always the option's (`add_pack_flags`). A new option's flag is one entry here."""

FLAGS = {
    "seq_len": "--seq-len",
    "checkpoint_every": "--checkpoint-every",
    "workers": "--workers",
    "dp": "--dp",
    "micro_batches": "--micro-batches",
    "rows_per_micro_batch": "--rows-per-micro-batch",
}
"""The other flags that take an int >= 1: argparse attribute -> the flag."""


def check_flags(args: argparse.Namespace) -> None:
    """Every number a command takes, in the flag's own terms, before any input is read.

    Raises:
        ValueError: naming the flag and the value (and, for ``--seq-len``, the padding flags).
    """
    from megapack.core.cp_pad import cp_pad_multiple

    least = {FLAGS[attr]: (attr, 1) for attr in FLAGS}
    least |= {
        flags[0]: (name, low) for name, (flags, low, _) in PACK_FLAGS.items() if low is not None
    }
    for flag, (attr, low) in least.items():
        value = getattr(args, attr, None)
        if value is not None and value < low:
            raise ValueError(f"{flag} must be an integer >= {low}, got {value}")
    multiple = cp_pad_multiple(args.cp_size, args.pad_to_multiple_of)
    if args.seq_len % multiple:  # rows hold whole padded documents
        why = (
            f"--pad-multiple {args.pad_to_multiple_of}"
            if args.cp_size == 1
            else (f"lcm(--pad-multiple {args.pad_to_multiple_of}, 2 x --cp-size {args.cp_size})")
        )
        raise ValueError(f"--seq-len {args.seq_len} must be a multiple of {multiple} ({why})")


def add_pack_flags(parser: Any, names: tuple[str, ...]) -> None:
    """Add the flags of these `PackOptions` fields (`PACK_FLAGS`), each defaulting to the
    option's own default."""
    for name in names:
        flags, _, keywords = PACK_FLAGS[name]
        parser.add_argument(*flags, dest=name, default=default_of(PackOptions, name), **keywords)


def packing_from(args: argparse.Namespace) -> PackOptions:
    """The `PackOptions` of the flags (a command without a flag, e.g. ``stats`` without
    --algorithm: the option's default, as ``pack``'s)."""
    given = {name: getattr(args, name) for name in PACK_FLAGS if hasattr(args, name)}
    return PackOptions(seq_len=args.seq_len, **given)
