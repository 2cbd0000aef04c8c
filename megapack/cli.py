"""The ``megapack`` command line: ``pack``, ``stats`` and ``bench``.

    megapack pack train.jsonl --seq-len 4096 --out packed/        # then PackedDataset.load("packed/")
    megapack stats train.jsonl --seq-len 4096 --plot lengths.png  # histogram, bound, every algorithm
    megapack bench --quick --json bench.json --plots plots/      # see megapack.bench

Inputs are anything `megapack.data.read_documents` reads (.jsonl/.json, megatron .bin/.idx, .npy/.npz).
A bad JSONL line stops the command with its file and line, or is skipped and counted with --skip-bad.
Errors in the input or the flags end the command with one line on stderr and exit code 2.
`python -m megapack` is the same command. ``--help`` never imports torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from megapack.cli_report import pack_report, plural

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


def _tokenizer(path: str | None, eos_token: str | None = None) -> Any:
    from megapack.data import ByteTokenizer, HFTokenizer

    if path:
        return HFTokenizer.from_file(path, eos_token=eos_token)
    if eos_token:
        raise ValueError(
            f"--eos-token {eos_token!r} needs --tokenizer: the built-in byte tokenizer's eos is fixed"
        )
    return ByteTokenizer()


def _open_reader(args: argparse.Namespace, tokenizer: Any, **options: Any) -> Any:
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
    if not _is_record_input(args.input):
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


def _read_lengths(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    """Document lengths of the input (streamed: no document is kept) and a bad-line note."""
    options = reader_options(args)
    reader = _open_reader(args, _tokenizer(args.tokenizer, args.eos_token), **options)
    docs = progress(reader, f"reading {args.input}")
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64)
    stats = getattr(reader, "stats", None)
    note = (
        f"{plural(stats.skipped, 'bad line')} skipped {dict(stats.skipped_by_problem)}"
        if stats and stats.skipped
        else ""
    )
    return lengths, note


def cmd_pack(args: argparse.Namespace) -> int:
    from itertools import islice

    from megapack.data.pack_writer import PackWriter
    from megapack.progress import Progress

    tokenizer = _tokenizer(args.tokenizer, args.eos_token)
    options = reader_options(args)
    same = {k: v for k, v in options.items() if k not in ("skip_bad", "workers")}  # may change
    config = {"input": str(Path(args.input).resolve()), "tokenizer": args.tokenizer, **same}
    start = time.perf_counter()
    writer = PackWriter(
        args.out, args.seq_len, pad_to_multiple_of=args.pad_to_multiple_of, cp_size=args.cp_size,
        algorithm=args.algorithm,
        long_docs=args.long_docs, seed=args.seed, pad_token_id=tokenizer.pad_id, config=config,
        resume=args.resume, checkpoint_every=args.checkpoint_every,
    )  # fmt: skip
    record = "fields" in options or _is_record_input(args.input)
    skip = {"skip": writer.rows_done} if record and writer.rows_done else {}
    reader = _open_reader(args, tokenizer, **options, **skip)
    if writer.rows_done:
        print(
            f"resuming after {writer.rows_done:,} input rows ({writer.documents:,} documents)",
            file=sys.stderr,
        )
        if not record:
            reader = islice(reader, writer.rows_done, None)
    path = Path(args.input)
    size = path.stat().st_size if path.is_file() else None
    progress = Progress(f"packing {args.input}", input_bytes=size)
    position = (lambda: int(reader.rows_done)) if hasattr(reader, "rows_done") else None
    source = reader.batches() if hasattr(reader, "batches") else reader  # whole batches: faster
    try:
        meta = writer.write(source, position=position, on_progress=progress.update)
    finally:
        progress.close()
    stats = getattr(reader, "stats", None)
    note = (
        f"{plural(stats.skipped, 'bad line')} skipped {dict(stats.skipped_by_problem)}"
        if stats is not None and stats.skipped
        else ""
    )
    for line in pack_report(meta, args.input, note):
        print(line)
    print(f"{args.algorithm} in {time.perf_counter() - start:.1f} s -> {args.out}")
    return 0


def _is_record_input(path: str) -> bool:
    return str(path).lower().endswith(RECORD_SUFFIXES) or Path(path).is_dir()


SHAPE_FLAGS = ("hidden", "ffn", "layers", "heads", "vocab")
"""The model-shape flags of ``stats`` (``--hidden`` ...), read by `megapack.cli_stats`."""


def _cmd_stats(args: argparse.Namespace) -> int:
    from megapack.cli_stats import cmd_stats

    return cmd_stats(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from megapack.bench import main as bench_main

    return bench_main(args)


class _DefaultsHelp(argparse.HelpFormatter):
    """Adds ``(default: X)`` to every optional flag's help that has a real default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        real = not any(action.default is v for v in (None, False, argparse.SUPPRESS))  # 0 is real
        if real and "%(default)" not in text and "(default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megapack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = _DefaultsHelp

    def data_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "input",
            help="a .jsonl/.json, .parquet/.arrow file or HF datasets directory, .bin/.idx "
            "(or prefix), .npy/.npz file",
        )
        p.add_argument("--seq-len", type=int, required=True, help="tokens per packed row")
        add_chat_arguments(p)
        add_reader_arguments(p)
        p.add_argument(
            "--skip-bad",
            action="store_true",
            help="skip and count bad JSONL lines instead of stopping at the first",
        )
        p.add_argument(
            "--eos-token",
            help="the --tokenizer's end-of-document token, e.g. '<|im_end|>' (default: from "
            "tokenizer_config.json beside it, else a common name in its vocabulary)",
        )
        p.add_argument(
            "--eos-id",
            type=int,
            help="for 1-D .npy/.npz token arrays: the token id that ends each document",
        )
        p.add_argument(
            "--cp-size", type=int, default=1,
            help="context-parallel size: pad documents to multiples of 2 x cp (with --pad-multiple: their lcm)",
        )  # fmt: skip
        p.add_argument(
            "--pad-multiple", "--pad-to-multiple-of", dest="pad_to_multiple_of", type=int, default=1,
            help="pad every document to a multiple of this (e.g. 8/16 for FP8 kernels); --seq-len "
            "must be a multiple of it",
        )  # fmt: skip

    pack = sub.add_parser(
        "pack",
        help="pack documents into a dataset PackedDataset.load reads",
        description="Pack documents into rows of --seq-len tokens; write a directory that "
        "megapack.data.PackedDataset.load(DIR, dp_rank=..., dp_size=...) memory-maps.",
        formatter_class=defaults,
    )
    data_args(pack)
    pack.add_argument("--out", required=True, help="output directory")
    from megapack.packing.names import ALGORITHMS, LONG_DOC_POLICIES

    pack.add_argument(
        "--algorithm",
        default=ALGORITHMS[0],
        choices=ALGORITHMS,
        help="bin-packing algorithm: best-fit / first-fit decreasing, first-fit, next-fit "
        "(streaming concat), or best (a search from bfd that never uses more rows)",
    )
    pack.add_argument(
        "--long-docs",
        default=LONG_DOC_POLICIES[0],
        choices=LONG_DOC_POLICIES,
        help="documents longer than --seq-len: split them (chat at message boundaries), keep "
        "their first --seq-len tokens, drop them, or stop with an error",
    )
    pack.add_argument(
        "--seed", type=int, default=0, help="seeds the packer and the per-epoch row shuffle"
    )
    pack.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted pack in --out from its last completed shard",
    )
    pack.add_argument(
        "--checkpoint-every",
        type=int,
        default=100_000,
        metavar="DOCS",
        help="documents per completed shard (checkpoint) of the output",
    )
    pack.set_defaults(func=cmd_pack)

    stats = sub.add_parser(
        "stats",
        help="length histogram, lower bound, every algorithm's efficiency",
        formatter_class=defaults,
    )
    data_args(stats)
    stats.add_argument("--plot", help="write a PNG histogram here")
    stats.add_argument(
        "--time-limit", type=float, default=10.0, help="seconds for the 'best' search"
    )
    stats.add_argument("--json", help="write every figure as JSON here")
    bal = stats.add_argument_group(
        "data-parallel balance (token plan vs compute plan, megapack.packing.balance)"
    )
    bal.add_argument("--dp", type=int, help="data-parallel ranks")
    bal.add_argument("--micro-batches", type=int, help="micro-batches per rank per step")
    bal.add_argument("--rows-per-micro-batch", type=int, default=1, help="rows per micro-batch")
    bal.add_argument("--seed", type=int, default=0, help="seed of the shuffle")
    for flag in (*SHAPE_FLAGS, "kv-heads"):
        bal.add_argument(f"--{flag}", type=int, help=f"model {flag} (cost model)")
    bal.add_argument("--gated", action="store_true", help="SwiGLU-style MLP (cost model)")
    bal.add_argument("--cost-a", type=float, help="row cost per token (instead of a shape)")
    bal.add_argument("--cost-b", type=float, help="row cost per squared document length")
    stats.set_defaults(func=_cmd_stats)

    from megapack.bench import add_arguments

    bench = sub.add_parser(
        "bench",
        help="packed vs padded throughput, transfer cost, packing quality",
        formatter_class=defaults,
    )
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return its exit code (2 for bad input or flags, with one line why)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, OSError, ImportError) as exc:  # the user's input, files or environment
        print(f"megapack {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. `megapack stats ... | head`: the reader left; not an error
        sys.stderr.close()
