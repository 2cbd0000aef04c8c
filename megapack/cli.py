"""The ``megapack`` command line: ``pack``, ``stats`` and ``bench``.

    megapack pack train.jsonl --seq-len 4096 --out packed/        # then PackedDataset.load("packed/")
    megapack stats train.jsonl --seq-len 4096 --plot lengths.png  # histogram, bound, every algorithm
    megapack bench --quick --json bench.json --plots plots/      # see megapack.bench

Inputs are anything `megapack.data.read_documents` reads (.jsonl/.json, megatron .bin/.idx, .npy/.npz).
A bad JSONL line stops the command with its file and line, or is skipped and counted with --skip-bad.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


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


def _tokenizer(path: str | None) -> Any:
    from megapack.data import ByteTokenizer, HFTokenizer

    return HFTokenizer.from_file(path) if path else ByteTokenizer()


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
    from megapack.data import read_documents

    options = reader_options(args)
    reader = read_documents(args.input, _tokenizer(args.tokenizer), **options)
    docs = progress(reader, f"reading {args.input}")
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64)
    stats = getattr(reader, "stats", None)
    note = (
        f"{stats.skipped:,} bad lines skipped {dict(stats.skipped_by_problem)}"
        if stats and stats.skipped
        else ""
    )
    return lengths, note


def cmd_pack(args: argparse.Namespace) -> int:
    from itertools import islice

    from megapack.data import read_documents
    from megapack.data.pack_writer import PackWriter
    from megapack.progress import Progress

    tokenizer = _tokenizer(args.tokenizer)
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
    reader = read_documents(args.input, tokenizer, **options, **skip)
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
    try:
        meta = writer.write(reader, position=position, on_progress=progress.update)
    finally:
        progress.close()
    stats = getattr(reader, "stats", None)
    if stats is not None and stats.skipped:
        print(
            f"{stats.skipped:,} bad lines skipped {dict(stats.skipped_by_problem)}", file=sys.stderr
        )
    print(
        f"packed {meta['documents']:,} documents into {meta['rows']:,} rows of {meta['seq_len']:,} tokens "
        f"({meta['efficiency']:.2%} efficiency, {meta['padding_tokens']:,} alignment padding tokens, lower bound "
        f"{meta['lower_bound']:,} rows, {args.algorithm}) "
        f"in {time.perf_counter() - start:.1f} s -> {args.out}"
    )
    return 0


def _is_record_input(path: str) -> bool:
    return str(path).lower().endswith(RECORD_SUFFIXES) or Path(path).is_dir()


def cmd_stats(args: argparse.Namespace) -> int:
    from megapack.cp import cp_pad_multiple
    from megapack.packing import plan

    lengths, note = _read_lengths(args)
    multiple = cp_pad_multiple(args.cp_size, args.pad_to_multiple_of)
    if len(lengths) == 0:
        print(f"{args.input}: no documents", file=sys.stderr)
        return 1
    figures: dict[str, Any] = {
        "input": args.input, "seq_len": args.seq_len, "documents": len(lengths),
        "tokens": int(lengths.sum()), "length_min": int(lengths.min()),
        "length_median": float(np.median(lengths)), "length_max": int(lengths.max()),
    }  # fmt: skip
    print(f"{len(lengths):,} documents, {int(lengths.sum()):,} tokens; length min {lengths.min()}, "
          f"median {int(np.median(lengths))}, mean {lengths.mean():.1f}, max {lengths.max()}" + (f"; {note}" if note else ""))  # fmt: skip
    print("\nlength histogram")
    edges = np.unique(np.geomspace(1, max(int(lengths.max()), 2), 12).astype(int))
    counts, _ = np.histogram(lengths, bins=np.append(edges, lengths.max() + 1))
    for lo, hi, n in zip(edges, np.append(edges[1:], lengths.max() + 1), counts, strict=True):
        print(f"  {lo:>7,}-{hi - 1:<7,} {n:>8,} {'#' * int(40 * n / max(counts.max(), 1))}")
    real = int(lengths.sum())
    planned = -(-lengths // multiple) * multiple  # rows are planned on padded lengths
    if multiple > 1:
        print(f"\ndocuments padded to multiples of {multiple} (cp_size={args.cp_size}, pad multiple "
              f"{args.pad_to_multiple_of}): +{int(planned.sum()) - real:,} tokens ({int(planned.sum()) / real - 1:.2%}); "
              "efficiency below counts real tokens only")  # fmt: skip
    print(f"\npacking at seq_len {args.seq_len:,}")
    print("| algorithm | rows | efficiency | seconds |\n| --- | --- | --- | --- |")
    results = {}
    from megapack.packing.names import ALGORITHMS, LONG_DOC_POLICIES

    for algorithm in ALGORITHMS:
        start = time.perf_counter()
        result = plan(planned, args.seq_len, algorithm=algorithm, time_limit_s=args.time_limit)
        results[algorithm] = result
        figures[f"rows_{algorithm}"] = result.num_bins
        figures[f"efficiency_{algorithm}"] = efficiency = _real_efficiency(
            result, real, planned, args.seq_len
        )
        print(
            f"| {algorithm} | {result.num_bins:,} | {efficiency:.2%} "
            f"| {time.perf_counter() - start:.2f} |"
        )
    bound = results["bfd"].lower_bound
    figures["lower_bound"] = bound
    print(
        f"| lower bound | {bound:,} | <= {min(real, int(planned.clip(max=args.seq_len).sum())) / (bound * args.seq_len):.2%} | |"
    )
    long = lengths > args.seq_len
    print(
        f"\n{int(long.sum()):,} documents longer than {args.seq_len:,} tokens ({int((lengths[long] - args.seq_len).sum()):,} tokens beyond)"
    )
    for policy in (p for p in LONG_DOC_POLICIES if p != "error"):
        r = plan(planned, args.seq_len, algorithm="bfd", long_docs=policy)
        print(
            f"  {policy:>8}: {r.truncated_tokens + r.dropped_tokens:,} tokens lost, {r.num_bins:,} rows"
        )
    if args.plot:
        _plot(lengths, args.seq_len, args.plot)
        print(f"\nplot -> {args.plot}")
    if args.dp is not None or args.micro_batches is not None or _cost_flags(args):
        figures.update(_balance_report(args, lengths))
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nJSON -> {args.json}")
    return 0


_SHAPE_FLAGS = ("hidden", "ffn", "layers", "heads", "vocab")


def _cost_flags(args: argparse.Namespace) -> list[str]:
    names = (*_SHAPE_FLAGS, "kv_heads", "cost_a", "cost_b")
    return [n for n in names if getattr(args, n) is not None] + (["gated"] if args.gated else [])


def _cost_model(args: argparse.Namespace) -> tuple[Any, str]:
    """The CostModel the flags describe, and a label; sum(len^2) when none is given."""
    from megapack.packing import CostModel

    given = _cost_flags(args)
    direct = args.cost_a is not None or args.cost_b is not None
    if direct and set(given) - {"cost_a", "cost_b"}:
        raise ValueError("give either --cost-a/--cost-b or a model shape (--hidden ...), not both")
    if direct:
        a, b = args.cost_a or 0.0, args.cost_b or 0.0
        return CostModel(a=a, b=b), f"a={a:g}, b={b:g}"
    if not given:
        return CostModel(
            a=0.0, b=1.0
        ), "sum(len^2) (no model given: --hidden ... or --cost-a/--cost-b)"
    missing = [f"--{n}" for n in _SHAPE_FLAGS if getattr(args, n) is None]
    if missing:
        raise ValueError(f"a model shape needs {', '.join(missing)} too (or use --cost-a/--cost-b)")
    shape = {n: getattr(args, n) for n in _SHAPE_FLAGS}
    model = CostModel.from_shape(**shape, kv_heads=args.kv_heads, gated=args.gated)
    return model, ", ".join(
        f"{k} {v}" for k, v in shape.items()
    ) + f" (a={model.a:.3g}, b={model.b:.3g})"


def _balance_report(args: argparse.Namespace, lengths: np.ndarray) -> dict[str, Any]:
    from megapack.packing.compare import compare_plans
    from megapack.packing.names import BALANCE_MODES

    cost, label = _cost_model(args)
    dp = 1 if args.dp is None else args.dp
    m = 1 if args.micro_batches is None else args.micro_batches
    r = compare_plans(
        lengths, args.seq_len, dp_size=dp, micro_batches=m,
        rows_per_micro_batch=args.rows_per_micro_batch, cost=cost, seed=args.seed,
    )  # fmt: skip
    print(f"\ndata-parallel balance: dp {dp}, {m} micro-batches of {args.rows_per_micro_batch} row(s)"
          f" per rank per step, {r['global_batches']:,} full global batches; cost {label}")  # fmt: skip
    print("| plan | imbalance (max / mean rank cost) | efficiency |\n| --- | --- | --- |")
    for mode in BALANCE_MODES:
        print(
            f"| {mode} | {r[f'imbalance_{mode}_plan']:.4f} | {r[f'efficiency_{mode}_plan']:.2%} |"
        )
    return r


def _real_efficiency(result: Any, real: int, planned: np.ndarray, seq_len: int) -> float:
    """Real tokens placed / (rows x seq_len): alignment padding is not counted as packed."""
    padding = (
        int(planned.sum()) - real
    )  # every document is placed ("split"), so all its padding too
    return (result.packed_tokens - padding) / max(result.num_bins * seq_len, 1)


def _plot(lengths: np.ndarray, seq_len: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=60, color="#4c72b0")
    ax.axvline(seq_len, color="#c44e52", linestyle="--", label=f"seq_len {seq_len:,}")
    ax.set(xlabel="document length (tokens)", ylabel="documents", title="document lengths")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    from megapack.bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megapack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

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
            help="skip and count bad JSONL lines instead of stopping",
        )
        p.add_argument(
            "--cp-size", type=int, default=1,
            help="context-parallel size: pad documents to multiples of 2 x cp (with --pad-multiple: their lcm)",
        )  # fmt: skip
        p.add_argument(
            "--pad-multiple", "--pad-to-multiple-of", dest="pad_to_multiple_of", type=int, default=1,
            help="pad every document to a multiple of this (e.g. 8/16 for FP8)",
        )  # fmt: skip

    pack = sub.add_parser("pack", help="pack documents into a dataset PackedDataset.load reads")
    data_args(pack)
    pack.add_argument("--out", required=True, help="output directory")
    from megapack.packing.names import ALGORITHMS, LONG_DOC_POLICIES

    pack.add_argument("--algorithm", default=ALGORITHMS[0], choices=ALGORITHMS)
    pack.add_argument("--long-docs", default=LONG_DOC_POLICIES[0], choices=LONG_DOC_POLICIES)
    pack.add_argument("--seed", type=int, default=0)
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
        help="documents per completed shard (checkpoint) of the output (default 100,000)",
    )
    pack.set_defaults(func=cmd_pack)

    stats = sub.add_parser(
        "stats", help="length histogram, lower bound, every algorithm's efficiency"
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
    for flag in (*_SHAPE_FLAGS, "kv-heads"):
        bal.add_argument(f"--{flag}", type=int, help=f"model {flag} (cost model)")
    bal.add_argument("--gated", action="store_true", help="SwiGLU-style MLP (cost model)")
    bal.add_argument("--cost-a", type=float, help="row cost per token (instead of a shape)")
    bal.add_argument("--cost-b", type=float, help="row cost per squared document length")
    stats.set_defaults(func=cmd_stats)

    from megapack.bench import add_arguments

    bench = sub.add_parser(
        "bench", help="packed vs padded throughput, transfer cost, packing quality"
    )
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"megapack {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
