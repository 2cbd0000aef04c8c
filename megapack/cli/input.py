"""How the ``megapack`` commands read their input: reader and chat flags, the tokenizer, the reader,
progress on stderr, and the document lengths ``stats`` plans from.

Shared by `megapack.cli` (which builds the parser and runs ``pack``) and `megapack.cli.stats`
(``stats``), so neither imports the other. Nothing here imports torch (``--help`` stays fast).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from megapack.cli.pack_report import plural

T = TypeVar("T")
READER_FLAGS = {"skip_bad": "--skip-bad", "eos_id": "--eos-id"}
"""Reader option -> the flag that sets it, to name the flag when an option does not fit the input."""


def progress(
    items: Iterable[T], label: str, *, every_s: float = 0.5, stream: Any = None
) -> Iterator[T]:
    """Yield ``items`` while showing a running count and rate on stderr (one line, redrawn)."""
    out = stream if stream is not None else sys.stderr
    start = last = time.perf_counter()
    count = 0
    for item in items:
        count += 1
        now = time.perf_counter()
        if now - last >= every_s:
            out.write(f"\r{label}: {count:,} ({count / (now - start):,.0f}/s)")
            out.flush()
            last = now
        yield item
    out.write(f"\r{label}: {count:,} in {time.perf_counter() - start:.1f} s\n")
    out.flush()


def tokenizer_from(path: str | None, eos_token: str | None = None) -> Any:
    from megapack.data import ByteTokenizer, HFTokenizer

    if path:
        return HFTokenizer.from_file(path, eos_token=eos_token)
    if eos_token:
        raise ValueError(
            f"--eos-token {eos_token!r} needs --tokenizer: the built-in byte tokenizer's eos is fixed"
        )
    return ByteTokenizer()


def tokenized_by(args: argparse.Namespace, tokenizer: Any, reader: Any) -> dict[str, Any]:
    """What ``meta.json`` records of the tokenizer (and what ``pack`` and ``stats`` print): the
    one that read text input (its --tokenizer path, else megapack's byte tokenizer), none for
    token ids read as they are (.bin/.idx, .npy/.npz; their --eos-id where given)."""
    used: Any = getattr(reader, "tokenizer", None)  # record readers keep the one they encode with
    if used is not None and used is tokenizer:
        name = str(args.tokenizer) if args.tokenizer else "megapack.data.ByteTokenizer"
        return {"tokenizer": name, "vocab_size": used.vocab_size, "eos_id": used.eos_id}
    return {"tokenizer": None, "vocab_size": None, "eos_id": getattr(args, "eos_id", None)}


def open_reader(args: argparse.Namespace, tokenizer: Any, **options: Any) -> Any:
    """`read_documents` for the input; an option the input's reader does not take names its flag."""
    from megapack.data import read_documents

    if getattr(args, "eos_id", None) is not None:
        options["eos_id"] = args.eos_id
    try:
        return read_documents(args.input, tokenizer, **options)
    except TypeError as e:
        flag = next((f for name, f in READER_FLAGS.items() if f"option {name!r}" in str(e)), None)
        if flag is None:
            raise
        raise ValueError(f"{flag} does not apply to {args.input} ({e})") from None


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """``--tokenizer`` and the chat template flags."""
    p.add_argument(
        "--tokenizer",
        help="a HF tokenizer directory (tokenizer.json + tokenizer_config.json; its chat_template "
        "renders chat records) or a bare tokenizer.json (default: the built-in byte tokenizer)",
    )
    p.add_argument(
        "--builtin-chat-template",
        action="store_true",
        help="render chats with megapack's built-in template even when the tokenizer has its own",
    )
    p.add_argument("--chat-template-name", help="which of several named chat templates to use")


def chat_options(args: argparse.Namespace) -> dict[str, Any]:
    """``chat_template=`` for record readers: the tokenizer directory's own template, if any."""
    if not args.tokenizer or args.builtin_chat_template or not Path(args.tokenizer).is_dir():
        return {}
    from megapack.data.hf_chat import HFChatTemplate

    template = HFChatTemplate.from_pretrained(args.tokenizer, name=args.chat_template_name)
    return {"chat_template": template} if template is not None else {}


RECORD_SUFFIXES = (
    ".jsonl",
    ".json",
    ".jsonl.gz",
    ".json.gz",
    ".parquet",
    ".arrow",
    ".feather",
    ".ipc",
)


def add_reader_arguments(p: argparse.ArgumentParser) -> None:
    """Column mapping, ``--shard`` and ``--workers`` for record inputs (JSONL, Parquet, Arrow)."""
    for part in ("text", "prompt", "completion", "messages", "tools"):
        p.add_argument(
            f"--{part}-field",
            default=part,
            metavar="KEY",
            help=f"key/column of the {part} (default {part})",
        )
    p.add_argument(
        "--shard",
        metavar="RANK/WORLD",
        help="read only this share of the rows (e.g. 0/8), disjoint across ranks",
    )
    p.add_argument(
        "--workers", type=int, default=1, help="processes converting rows (default 1: this one)"
    )


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/8"`` -> ``(2, 8)``; ValueError naming --shard otherwise."""
    try:
        rank, world = (int(v) for v in text.replace(",", "/").split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected RANK/WORLD, e.g. 0/8") from None
    return rank, world


def reader_options(args: argparse.Namespace) -> dict[str, Any]:
    """Options for `read_documents` from the flags; record-only ones only for record inputs."""
    options: dict[str, Any] = {"skip_bad": True} if args.skip_bad else {}
    if not is_record_input(args.input):
        return options
    from megapack.data import Fields

    parts = ("text", "prompt", "completion", "messages", "tools")
    fields = Fields(**{part: getattr(args, f"{part}_field") for part in parts})
    if fields != Fields():
        options["fields"] = fields
    if args.shard:
        options["shard"] = parse_shard(args.shard)
    if args.workers != 1:
        options["workers"] = args.workers
    return options | chat_options(args)


@dataclass(frozen=True, kw_only=True, slots=True)
class InputLengths:
    """What ``stats`` reads of its input (`read_lengths`): lengths only, no document is kept."""

    lengths: np.ndarray
    """Each document's tokens (int64)."""
    pieces: np.ndarray
    """The lengths `megapack pack` packs by default: each document longer than ``--seq-len``
    as the pieces `split_document` cuts it into (at message boundaries where it can)."""
    note: str
    """The bad lines skipped (with --skip-bad), or ""."""
    tokenized: dict[str, Any]
    """The tokenizer, as `tokenized_by` names it."""


def read_lengths(args: argparse.Namespace) -> InputLengths:
    """The input's document lengths, streamed (see `InputLengths`)."""
    from megapack.data.split import split_document

    options = reader_options(args)
    tokenizer = tokenizer_from(args.tokenizer, args.eos_token)
    reader = open_reader(args, tokenizer, **options)
    lengths: list[int] = []
    pieces: list[int] = []
    for doc in progress(reader, f"reading {args.input}"):
        lengths.append(len(doc))
        if len(doc) > args.seq_len:
            pieces += [len(p) for p in split_document(doc, args.seq_len)]
        else:
            pieces.append(len(doc))
    stats = getattr(reader, "stats", None)
    note = (
        f"{plural(stats.skipped, 'bad line')} skipped {dict(stats.skipped_by_problem)}"
        if stats and stats.skipped
        else ""
    )
    return InputLengths(
        lengths=np.array(lengths, dtype=np.int64),
        pieces=np.array(pieces, dtype=np.int64),
        note=note,
        tokenized=tokenized_by(args, tokenizer, reader),
    )


SHAPE_FLAGS = ("hidden", "ffn", "layers", "heads", "vocab")
"""The model-shape flags of ``stats`` (``--hidden`` ...), defined by `megapack.cli`, read by `megapack.cli.stats`."""


def is_record_input(path: str) -> bool:
    """Whether ``path`` is a record input (Parquet/Arrow/a dataset directory), whose rows have fields."""
    return str(path).lower().endswith(RECORD_SUFFIXES) or Path(path).is_dir()
