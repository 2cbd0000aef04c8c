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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megapack.cli.flags import add_pack_flags, check_flags, packing_from
from megapack.cli.input import (
    SHAPE_FLAGS,
    add_chat_arguments,
    add_reader_arguments,
    is_record_input,
    open_reader,
    reader_options,
    tokenized_by,
    tokenizer_from,
)
from megapack.cli.pack_report import no_documents, pack_report, plural

SKIP_BAD = "or pass --skip-bad to skip such lines and count them (the report gives the count)"
"""What a bad input line's error adds: the flag that skips and counts bad lines instead."""


def cmd_pack(args: argparse.Namespace) -> int:
    """Pack into ``--out``: written whole in ``<out>.partial/``, renamed at the end, so a failed
    run leaves no half-written ``--out``; its checkpoints (``--resume``) stay in ``.partial``."""
    import shutil

    out = Path(args.out)
    staging = check_out(out, resume=args.resume)
    try:
        return _pack(args, out, staging)
    except BaseException as exc:
        if not (staging / "progress.json").is_file():  # nothing to resume: nothing is left
            shutil.rmtree(staging, ignore_errors=True)
        elif isinstance(exc, ValueError | OSError):
            raise ValueError(
                f"{exc} (the pack so far is kept in {staging}/: rerun with --resume "
                "to continue it, or remove it)"
            ) from exc
        raise


def check_out(out: Path, *, resume: bool) -> Path:
    """``--out`` checked before any work; returns the staging directory ``<out>.partial``."""
    staging = out.with_name(out.name + ".partial")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory path (a new one)")
    if (out / "meta.json").is_file():
        raise ValueError(
            f"--out {out} already holds a finished pack (meta.json); choose another --out or remove it"
        )
    if (
        out.is_dir() and (out / "progress.json").is_file()
    ):  # an unfinished pack of an earlier megapack
        if not resume:
            raise ValueError(
                f"--out {out} holds an unfinished pack: pass --resume to continue it, or remove it"
            )
        if not staging.exists():
            out.rename(staging)
    elif out.is_dir() and any(out.iterdir()):
        raise ValueError(
            f"--out {out} is a directory that is not empty; choose a new path or remove it"
        )
    if (staging / "progress.json").is_file() and not resume:
        raise ValueError(
            f"{staging} holds an unfinished pack of --out {out}: pass --resume to "
            "continue it, or remove it to start over"
        )
    return staging


def _pack(args: argparse.Namespace, out: Path, staging: Path) -> int:
    from itertools import islice

    from megapack.cli.progress import Progress
    from megapack.data.pack_writer import PackWriter
    from megapack.data.packed_dir import NothingToPack

    tokenizer = tokenizer_from(args.tokenizer, args.eos_token)
    options = reader_options(args)
    same = {k: v for k, v in options.items() if k not in ("skip_bad", "workers")}  # may change
    config = {"input": str(Path(args.input).resolve()), "tokenizer": args.tokenizer, **same}
    start = time.perf_counter()
    reader = open_reader(args, tokenizer, **options)  # a missing input fails here, before a write
    writer = PackWriter(
        staging,
        packing_from(args),
        pad_token_id=tokenizer.pad_id,
        config=config,
        resume=args.resume,
        checkpoint_every=args.checkpoint_every,
        **tokenized_by(args, tokenizer, reader),
    )
    record = "fields" in options or is_record_input(args.input)
    if writer.rows_done and record:  # the reader again, after the checkpoint's rows
        reader = open_reader(args, tokenizer, **options, skip=writer.rows_done)
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
    except BaseException as exc:
        progress.close(done=False)
        if isinstance(exc, NothingToPack):
            raise ValueError(f"{args.input}: {no_documents(reader)}: nothing to pack") from exc
        raise
    progress.close()
    if out.is_dir():
        out.rmdir()  # an empty directory given as --out (check_out refused any other)
    staging.rename(out)
    stats = getattr(reader, "stats", None)
    note = (
        f"{plural(stats.skipped, 'bad line')} skipped {dict(stats.skipped_by_problem)}"
        if stats is not None and stats.skipped
        else ""
    )
    lengths = input_lengths(out)
    multiple = packing_from(args).multiple
    for line in pack_report(meta, args.input, note, lengths=lengths, multiple=multiple):
        print(line)
    print(f"{args.algorithm} in {time.perf_counter() - start:.1f} s -> {args.out}")
    return 0


def input_lengths(folder: Path) -> Any:
    """The input documents' lengths of a packed ``folder`` (each document's pieces added up by
    ``origins.npy``), or None for a folder without origins (one resumed from an older pack)."""
    import numpy as np

    if not (folder / "origins.npy").is_file():
        return None
    pieces = np.diff(np.load(folder / "doc_offsets.npy"))
    return np.bincount(np.load(folder / "origins.npy"), weights=pieces).astype(np.int64)


def _cmd_stats(args: argparse.Namespace) -> int:
    from megapack.cli.stats import cmd_stats

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
        add_pack_flags(p, ("cp_size", "pad_to_multiple_of", "search_steps", "seed"))

    pack = sub.add_parser(
        "pack",
        help="pack documents into a dataset PackedDataset.load reads",
        description="Pack documents into rows of --seq-len tokens; write a directory that "
        "megapack.data.PackedDataset.load(DIR, dp_rank=..., dp_size=...) memory-maps.",
        formatter_class=defaults,
    )
    data_args(pack)
    pack.add_argument("--out", required=True, help="output directory")
    add_pack_flags(pack, ("algorithm", "long_docs", "max_documents"))
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
    stats.add_argument("--json", help="write every figure as JSON here")
    bal = stats.add_argument_group(
        "data-parallel balance (token plan vs compute plan, megapack.packing.balance)"
    )
    bal.add_argument("--dp", type=int, help="data-parallel ranks")
    bal.add_argument("--micro-batches", type=int, help="micro-batches per rank per step")
    bal.add_argument("--rows-per-micro-batch", type=int, help="rows per micro-batch (default 1)")
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
        if args.command in ("pack", "stats"):
            check_flags(args)
        return int(args.func(args))
    except (ValueError, OSError, ImportError) as exc:  # the user's input, files or environment
        print(f"megapack {args.command}: error: {explain(exc, args)}", file=sys.stderr)
        return 2


def explain(exc: BaseException, args: argparse.Namespace) -> str:
    """The one line an error prints: its message, and for a bad input line (a `BadLineError`,
    itself or the cause of ``pack``'s note on what is kept) the ``--skip-bad`` way past it."""
    records = sys.modules.get("megapack.data.records")  # not loaded: no line was read
    bad = records is not None and any(
        isinstance(e, records.BadLineError) for e in (exc, exc.__cause__)
    )
    if not bad or getattr(args, "skip_bad", False):
        return str(exc)
    return f"{exc}; {SKIP_BAD}"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. `megapack stats ... | head`: the reader left; not an error
        sys.stderr.close()
