"""``megapack stats``: the length histogram, every algorithm's rows and efficiency against the lower
bound, what each long-document policy loses, and (with ``--dp``/``--micro-batches``/a cost) the
token plan's and the compute plan's data-parallel imbalance.

Split from `megapack.cli`, which builds the parser; the input flags live in `megapack.cli.input`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import numpy as np

from megapack.cli.flags import packing_from
from megapack.cli.input import SHAPE_FLAGS, read_lengths
from megapack.cli.pack_report import covering_seq_lens, plural, seq_len_advice, tokenizer_line
from megapack.packing.options import PackOptions


def cmd_stats(args: argparse.Namespace) -> int:
    """Print (and with --json/--plot write, at the end) the figures of the module docstring.

    Raises:
        ValueError: an input with no documents (naming it; nothing is written), or bad flags.
    """
    from megapack.packing import plan

    options = packing_from(args)
    read = read_lengths(args)
    lengths, pieces, note = read.lengths, read.pieces, read.note
    if len(lengths) == 0:
        raise ValueError(f"{args.input}: no documents in it" + (f" ({note})" if note else ""))
    figures: dict[str, Any] = {
        "input": args.input,
        "seq_len": args.seq_len,
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "length_min": int(lengths.min()),
        "length_median": float(np.median(lengths)),
        "length_max": int(lengths.max()),
        **read.tokenized,
    }
    print(
        f"{plural(len(lengths), 'document')}, {plural(int(lengths.sum()), 'token')}; length min {lengths.min()}, "
        f"median {int(np.median(lengths))}, mean {lengths.mean():.1f}, max {lengths.max()}"
        + (f"; {note}" if note else "")
    )
    print(tokenizer_line(read.tokenized))
    print("\nlength histogram")
    edges = np.unique(np.geomspace(1, max(int(lengths.max()), 2), 12).astype(int))
    counts, _ = np.histogram(lengths, bins=np.append(edges, lengths.max() + 1))
    for lo, hi, n in zip(edges, np.append(edges[1:], lengths.max() + 1), counts, strict=True):
        print(f"  {lo:>7,}-{hi - 1:<7,} {n:>8,} {'#' * int(40 * n / max(counts.max(), 1))}")
    real = int(lengths.sum())
    multiple = options.multiple  # pack's rows: long documents split (`pieces`), each padded
    padding = int((-pieces % multiple).sum())
    if multiple > 1:
        print(
            f"\ndocuments padded to multiples of {multiple} (cp_size={args.cp_size}, pad multiple "
            f"{args.pad_to_multiple_of}): +{padding:,} tokens ({padding / real:.2%}); "
            "efficiency below counts real tokens only"
        )
    print(f"\npacking at seq_len {args.seq_len:,}")
    print("| algorithm | rows | efficiency | seconds |\n| --- | --- | --- | --- |")
    results = {}
    from megapack.packing.names import ALGORITHMS, LONG_DOC_POLICIES

    for algorithm in ALGORITHMS:
        start = time.perf_counter()
        result = plan(pieces, replace(options, algorithm=algorithm))
        results[algorithm] = result
        figures[f"rows_{algorithm}"] = result.num_bins
        figures[f"efficiency_{algorithm}"] = result.efficiency  # real tokens
        print(
            f"| {algorithm} | {result.num_bins:,} | {result.efficiency:.2%} "
            f"| {time.perf_counter() - start:.2f} |"
        )
    bound = results["bfd"].lower_bound
    figures["lower_bound"] = bound
    # every real token is packed ("split"): the bound's efficiency counts all of them, never a
    # length clipped at seq_len (which once printed "<= 38.84%", below what bfd achieved)
    print(f"| lower bound | {bound:,} | <= {real / (bound * args.seq_len):.2%} | |")
    figures.update(_suggest_cap(results["bfd"], pieces, replace(options, algorithm="bfd")))
    long = lengths > args.seq_len
    figures["documents_longer"] = int(long.sum())
    print(
        f"\n{int(long.sum()):,} of {plural(len(lengths), 'document')} longer than --seq-len "
        f"{args.seq_len:,} ({plural(int((lengths[long] - args.seq_len).sum()), 'token')} beyond)"
        + (": `megapack pack` splits them by default (--long-docs)" if long.any() else "")
    )
    for line in seq_len_advice(lengths, args.seq_len, multiple=options.multiple):
        print(line)
    covering = covering_seq_lens(lengths, multiple=options.multiple)
    figures["seq_len_covering"] = {f"{share:g}": length for share, length in covering.items()}
    for policy in (p for p in LONG_DOC_POLICIES if p != "error"):
        # "split" as pack splits: at message boundaries where it can (the table above)
        r = (
            results["bfd"]
            if policy == "split"
            else plan(lengths, replace(options, algorithm="bfd", long_docs=policy))
        )
        how = (
            f" (at message boundaries where possible: {plural(len(pieces), 'piece')})"
            if policy == "split"
            else ""
        )
        print(
            f"  {policy:>8}: {plural(r.truncated_tokens + r.dropped_tokens, 'token')} lost, {plural(r.num_bins, 'row')}{how}"
        )
    if args.plot:
        _plot(lengths, args.seq_len, args.plot)
        print(f"\nplot -> {args.plot}")
    if args.dp is not None or args.micro_batches is not None or _cost_flags(args):
        figures.update(_balance_report(args, pieces, replace(options, algorithm="bfd")))
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nJSON -> {args.json}")
    return 0


CAP_SHARE = 0.99
"""The suggested --max-documents keeps at least this share of the plan's rows as they are."""


def _suggest_cap(result: Any, pieces: np.ndarray, options: PackOptions) -> dict[str, Any]:
    """The smallest documents-per-row cap that keeps `CAP_SHARE` of bfd's rows, and what it costs."""
    from megapack.packing import plan

    per_row = np.diff(result.bin_offsets)
    cap = int(np.quantile(per_row, CAP_SHARE, method="higher"))
    capped = plan(pieces, replace(options, max_documents=cap))
    kept = float((per_row <= cap).mean())
    efficiency = capped.efficiency
    print(
        f"\nstatic shapes (CUDA graphs): --max-documents {cap} keeps {kept:.2%} of the rows as they "
        f"are; capped: {plural(capped.num_bins, 'row')} (+{capped.num_bins - result.num_bins:,}), "
        f"{efficiency:.2%} efficiency; a micro-batch of R rows then has at most R x {cap + 1} "
        "segments (megapack.core.static.segments_for)"
    )
    return {
        "suggested_max_documents": cap,
        "rows_at_suggested_cap": capped.num_bins,
        "rows_kept_at_suggested_cap": kept,
    }


def _cost_flags(args: argparse.Namespace) -> list[str]:
    names = (*SHAPE_FLAGS, "kv_heads", "cost_a", "cost_b")
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
    missing = [f"--{n}" for n in SHAPE_FLAGS if getattr(args, n) is None]
    if missing:
        raise ValueError(f"a model shape needs {', '.join(missing)} too (or use --cost-a/--cost-b)")
    shape = {n: getattr(args, n) for n in SHAPE_FLAGS}
    model = CostModel.from_shape(**shape, kv_heads=args.kv_heads, gated=args.gated)
    return model, ", ".join(
        f"{k} {v}" for k, v in shape.items()
    ) + f" (a={model.a:.3g}, b={model.b:.3g})"


def _balance_report(
    args: argparse.Namespace, pieces: np.ndarray, options: PackOptions
) -> dict[str, Any]:
    from megapack.packing.compare import compare_plans
    from megapack.packing.names import BALANCE_MODES
    from megapack.packing.options import LoadOptions

    cost, label = _cost_model(args)
    given = {"dp_size": args.dp, "micro_batches": args.micro_batches}
    given["rows_per_micro_batch"] = args.rows_per_micro_batch
    deal = LoadOptions(**{k: v for k, v in given.items() if v is not None}, cost=cost)
    r = compare_plans(pieces, options, deal)
    dp, m = deal.dp_size, deal.micro_batches
    print(
        f"\ndata-parallel balance: dp {dp}, {m} micro-batches of {deal.rows_per_micro_batch} row(s)"
        f" per rank per step, {r['global_batches']:,} full global batches; cost {label}"
    )
    print("| plan | imbalance (max / mean rank cost) | efficiency |\n| --- | --- | --- |")
    for mode in BALANCE_MODES:
        print(
            f"| {mode} | {r[f'imbalance_{mode}_plan']:.4f} | {r[f'efficiency_{mode}_plan']:.2%} |"
        )
    return r


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
