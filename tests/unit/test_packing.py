"""megapack.packing.plan and PackPlan: worked examples, long documents, argument errors, property-based
invariants for every algorithm and long-document policy, and randomized comparisons of the fast
greedy algorithms against simple per-item reference implementations written here."""

from __future__ import annotations

import doctest
import importlib
import itertools
import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megapack.bench.datasets import bundled_lengths_path
from megapack.packing import (
    ALGORITHMS,
    LONG_DOC_POLICIES,
    LoadOptions,
    PackOptions,
    PackPlan,
    lower_bound,
    plan,
)

OPENCHAT = bundled_lengths_path()  # package data: always there, never skipped
FAST: dict[str, Any] = {"search_steps": 200}  # keeps "best" quick


# -- helpers: independent checks and references --------------------------------------------------
def check_plan(p: PackPlan, lengths: list[int], seq_len: int, long_docs: str) -> None:
    """Every kept token appears exactly once; no bin is empty or over seq_len."""
    assert p.seq_len == seq_len and p.num_docs == len(lengths)
    loads = []
    pieces: dict[int, list[tuple[int, int]]] = {}
    for b in p.bins:
        assert b, "empty bin"
        loads.append(sum(stop - start for _, start, stop in b))
        for doc, start, stop in b:
            assert 0 <= start < stop
            pieces.setdefault(doc, []).append((start, stop))
    assert all(load <= seq_len for load in loads)
    assert loads == p.bin_loads.tolist()
    for i, length in enumerate(lengths):
        if length > seq_len and long_docs == "drop":
            assert i not in pieces
            continue
        want = min(length, seq_len) if long_docs == "truncate" else length
        spans = sorted(pieces.pop(i))
        assert spans[0][0] == 0 and spans[-1][1] == want, (i, spans)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans
    assert not pieces, f"slices of unknown documents {sorted(pieces)}"
    long = [n for n in lengths if n > seq_len]
    assert p.num_split_docs == (len(long) if long_docs == "split" else 0)
    assert p.truncated_tokens == (sum(n - seq_len for n in long) if long_docs == "truncate" else 0)
    assert p.dropped_tokens == (sum(long) if long_docs == "drop" else 0)
    assert (
        p.packed_tokens
        == sum(min(n, seq_len) if long_docs == "truncate" else n for n in lengths)
        - p.dropped_tokens
    )
    total = p.packed_tokens
    assert -(-total // seq_len) <= p.lower_bound <= p.num_bins


def reference(sizes: list[int], seq_len: int, rule: str) -> list[int]:
    """Per-item next/first/best fit; returns the bin of every item in the order given."""
    free: list[int] = []
    out = []
    for s in sizes:
        fits = [b for b, f in enumerate(free) if f >= s]
        if rule == "next":
            fits = [len(free) - 1] if free and free[-1] >= s else []
        elif rule == "best":
            fits = sorted(fits, key=lambda b: (free[b], b))
        if fits:
            free[fits[0]] -= s
            out.append(fits[0])
        else:
            free.append(seq_len - s)
            out.append(len(free) - 1)
    return out


def reference_loads(lengths: list[int], seq_len: int, rule: str, decreasing: bool) -> list[int]:
    order = (
        sorted(range(len(lengths)), key=lambda i: -lengths[i])
        if decreasing
        else range(len(lengths))
    )
    sizes = [lengths[i] for i in order]
    where = reference(sizes, seq_len, rule)
    loads = [0] * (max(where) + 1 if where else 0)
    for s, b in zip(sizes, where, strict=True):
        loads[b] += s
    return loads


# -- worked examples -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("algorithm", "bins"),
    [
        ("bfd", [[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]]),
        ("ffd", [[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]]),
        ("best", [[(2, 0, 4)], [(0, 0, 3), (1, 0, 2)]]),
        ("first_fit", [[(0, 0, 3), (1, 0, 2)], [(2, 0, 4)]]),
        ("next_fit", [[(0, 0, 3), (1, 0, 2)], [(2, 0, 4)]]),
    ],
)
def test_lengths_3_2_4_capacity_5(algorithm: str, bins: list) -> None:
    p = plan([3, 2, 4], 5, algorithm=algorithm)
    assert p.bins == bins
    assert p.bin_offsets.tolist() == [0, len(bins[0]), 3]
    assert (p.num_bins, p.efficiency, p.lower_bound, p.gap) == (2, 0.9, 2, 0)
    assert p.algorithm == algorithm


def test_first_fit_looks_back_next_fit_does_not() -> None:
    assert plan([4, 3, 1], 5, algorithm="first_fit").bins == [[(0, 0, 4), (2, 0, 1)], [(1, 0, 3)]]
    assert plan([4, 3, 1], 5, algorithm="next_fit").bins == [[(0, 0, 4)], [(1, 0, 3), (2, 0, 1)]]


def test_best_fit_and_first_fit_decreasing_differ() -> None:
    # Sorted 5, 3, 3, 1 at seq_len 7: the 1 goes to the first bin with room (FFD: beside the 5)
    # or to the fullest bin that holds it (BFD: beside 3 + 3).
    assert plan([5, 3, 3, 1], 7, algorithm="ffd").bins == [
        [(0, 0, 5), (3, 0, 1)],
        [(1, 0, 3), (2, 0, 3)],
    ]
    assert plan([5, 3, 3, 1], 7, algorithm="bfd").bins == [
        [(0, 0, 5)],
        [(1, 0, 3), (2, 0, 3), (3, 0, 1)],
    ]


def test_best_beats_bfd_on_a_hand_example() -> None:
    lengths = [3, 3, 2, 2, 2, 2, 3, 3]  # BFD: 3+3+3 | 2+2+2+3 | 2 ; optimum: two bins of 10
    assert plan(lengths, 10).num_bins == 3
    p = plan(lengths, 10, algorithm="best")
    assert p.num_bins == 2 == p.lower_bound and p.efficiency == 1.0
    check_plan(p, lengths, 10, "split")


def test_split_long_document() -> None:
    p = plan([12], 5)
    assert p.bins == [[(0, 0, 5)], [(0, 5, 10)], [(0, 10, 12)]]
    assert (p.num_split_docs, p.split_tokens, p.packed_tokens) == (1, 12, 12)


@pytest.mark.parametrize(
    ("policy", "bins", "counters", "line"),
    [
        ("truncate", [[(0, 0, 5)], [(1, 0, 3)]], {"num_truncated_docs": 1, "truncated_tokens": 7}, "1 truncated (7 tokens lost)"),
        ("drop", [[(1, 0, 3)]], {"num_dropped_docs": 1, "dropped_tokens": 12}, "1 dropped (12 tokens lost)"),
        ("split", [[(0, 0, 5)], [(0, 5, 10)], [(0, 10, 12), (1, 0, 3)]], {"num_split_docs": 1, "split_tokens": 12}, "1 split (12 tokens, all packed)"),
    ],
)  # fmt: skip
def test_long_document_policies(policy: str, bins: list, counters: dict, line: str) -> None:
    p = plan([12, 3], 5, long_docs=policy)
    assert p.bins == bins
    for name, value in counters.items():
        assert getattr(p, name) == value
    assert line in p.report()


def test_long_document_error_names_index_and_length() -> None:
    with pytest.raises(ValueError, match=r"document 2 has 9 tokens, more than seq_len=5"):
        plan([1, 5, 9, 7], 5, long_docs="error")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lengths": [3, 0, 2]}, ValueError, r"lengths\[1\] = 0"),
        ({"lengths": [3, -4]}, ValueError, r"lengths\[1\] = -4"),
        ({"lengths": [1.5, 2.0]}, TypeError, "dtype float64"),
        ({"lengths": [[1, 2]]}, ValueError, "1-D"),
        ({"seq_len": 0}, ValueError, "seq_len must be an int >= 1, got 0"),
        ({"seq_len": 2.5}, TypeError, "seq_len must be an int"),
        ({"algorithm": "worst"}, ValueError, "algorithm must be one of"),
        ({"long_docs": "fold"}, ValueError, "long_docs must be one of"),
        ({"algorithm": 3}, TypeError, "^algorithm must be one of .*, got int 3$"),
        ({"seed": True}, TypeError, "seed must be an int"),
        ({"seed": -1}, ValueError, "seed must be an int >= 0, got -1"),
        ({"search_steps": -1}, ValueError, "^search_steps must be an int >= 0, got -1$"),
        ({"search_steps": 2.0}, TypeError, "^search_steps must be an int >= 0, got float 2.0$"),
        ({"time_limit_s": 1.0}, TypeError, "unexpected keyword argument 'time_limit_s'; its "
         "PackOptions shortcuts are seq_len, algorithm,"),
        ({"balance": "token"}, TypeError, "unexpected keyword argument 'balance'"),
    ],
)  # fmt: skip
def test_argument_errors(kwargs: dict, error: type, match: str) -> None:
    args = {"lengths": [3, 2], "seq_len": 5, **kwargs}
    with pytest.raises(error, match=match):
        plan(args.pop("lengths"), args.pop("seq_len"), **args)


def test_lengths_are_checked_and_converted_to_int64() -> None:
    """`as_lengths`: any integer array (object arrays of ints too) becomes int64; anything else
    is a TypeError naming the dtype and the fix; `make_pieces` names a bad policy itself."""
    from megapack.packing.pieces import as_lengths, make_pieces

    for given_lengths in ([], np.array([3, 2], dtype=np.uint8), np.array([3, 2], dtype=object)):
        out = as_lengths(given_lengths)
        assert out.dtype == np.int64 and out.tolist() == list(given_lengths)
    hint = r"; convert with np\.asarray\(lengths, dtype=np\.int64\) after rounding$"
    for bad, dtype in (([1.5, 2.0], "float64"), ([True, False], "bool"), (["3"], "<U1")):
        with pytest.raises(
            TypeError,
            match=rf"^lengths must hold integers \(token counts\), got dtype {dtype}{hint}",
        ):
            as_lengths(bad)
    for bad in ([3, True], [3, "3"], [3, 2.0]):  # mixed objects: every one must be an integer
        with pytest.raises(TypeError, match=rf"^sizes must hold .* got dtype object{hint}"):
            as_lengths(np.array(bad, dtype=object), name="sizes")
    with pytest.raises(
        ValueError,
        match=r"^long_docs must be one of \('split', 'truncate', 'drop', 'error'\), got 'fold'$",
    ):
        make_pieces(np.array([3]), 5, "fold")
    with pytest.raises(
        ValueError,
        match=r"^document 7 of the stream has 9 tokens, more than seq_len=5 \(1 document\(s\) are too long\); use long_docs='split', 'truncate' or 'drop' \(megapack pack: --long-docs split\)$",
    ):
        make_pieces(np.array([3, 9]), 5, "error", first=6, where=" of the stream")


def test_plan_defaults_and_seeds_reach_the_search_and_the_shuffle() -> None:
    """The seed picks the "best" search's path and the rows' shuffle (the seeded permutation a
    data loader deals, `order_rows`); the defaults are seed 0 and one rank, one micro-batch."""
    from megapack.packing import CostModel

    lengths = [18, 17, 20, 32, 33, 25, 28, 38, 25, 15, 4, 22, 10, 24, 2, 34, 37, 6, 32, 16, 2,
               36, 37, 2, 24, 33, 31, 17, 34, 33]  # fmt: skip
    best = [plan(lengths, 64, algorithm="best", seed=s, **FAST).bins for s in (0, 1, 1)]
    assert best[0] != best[1] == best[2]  # the seed matters, and the same seed repeats
    assert plan(lengths, 64, algorithm="best", **FAST).bins == best[0]
    plain = plan(lengths, 64)
    token = LoadOptions()
    for seed in (0, 5):
        perm = np.random.default_rng(seed).permutation(plain.num_bins).tolist()
        shuffled = plan(lengths, 64, loading=token, seed=seed)
        assert shuffled.bins == [plain.bins[i] for i in perm]
    assert plan(lengths, 64, loading=token).bins == [plain.bins[i] for i in
        np.random.default_rng(0).permutation(plain.num_bins).tolist()]  # fmt: skip
    compute = LoadOptions(balance="compute", cost=CostModel(a=0, b=1))
    many = (np.random.default_rng(1).lognormal(3, 1, 300).astype(int) + 1).tolist()
    one_rank = plan(many, 64, loading=replace(compute, dp_size=1, micro_batches=1), seed=0)
    assert plan(many, 64, loading=compute).bins == one_rank.bins
    assert plan(many, 64, loading=compute, seed=2).bins != one_rank.bins


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=60),
    seq_len=st.integers(8, 30),
    algorithm=st.sampled_from(ALGORITHMS),
)
def test_slices_within_a_bin_are_in_document_order(
    lengths: list[int], seq_len: int, algorithm: str
) -> None:
    p = plan(lengths, seq_len, algorithm=algorithm, **FAST)
    for b in p.bins:
        assert b == sorted(b)  # by document, then by start (pieces of a split document)


def test_empty_input_and_numpy_input() -> None:
    p = plan([], 8)
    assert (p.num_bins, p.bins, p.efficiency, p.lower_bound) == (0, [], 0.0, 0)
    assert "0 bins" in p.report()
    q = plan(np.array([3, 2, 4], dtype=np.uint16), np.int64(5))
    assert q == plan([3, 2, 4], 5) and q != plan([3, 2, 4], 5, algorithm="next_fit")


def test_padding_multiple_worked_example() -> None:
    """Lengths [3, 5] at seq_len 8 padded to multiples of 2: 4 + 6 > 8, so two rows of real
    tokens 3 and 5 (efficiency 8 / 16), 2 slots of padding; unpadded they share one row."""
    p = plan([3, 5], PackOptions(seq_len=8, pad_to_multiple_of=2))
    assert p.bins == [[(1, 0, 5)], [(0, 0, 3)]] and p.multiple == 2
    assert (p.padding_tokens, p.efficiency, p.bin_slots.tolist()) == (2, 0.5, [6, 4])
    assert plan([3, 5], 8).num_bins == 1
    assert plan([3, 5], PackOptions(seq_len=8, cp_size=2)).multiple == 4  # 2 x cp_size
    together = {"bin_offsets": np.array([0, 2]), "slices": np.array([[0, 0, 3], [1, 0, 5]])}
    shared = PackPlan(seq_len=8, algorithm="x", lower_bound=1, num_docs=2, **together)
    assert shared.validate() is shared  # 3 + 5 real tokens fit
    with pytest.raises(ValueError, match=r"^bin 0 holds 10 tokens > seq_len=8$"):
        replace(shared, multiple=2).validate()  # padded, 4 + 6 do not


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    pad=st.sampled_from([1, 2, 4, 8]),
    cp=st.sampled_from([1, 2]),
    policy=st.sampled_from(["split", "truncate", "drop"]),
    algorithm=st.sampled_from(ALGORITHMS),
)
def test_padding_multiple_plans_padded_pieces_of_real_tokens(
    lengths: list[int], pad: int, cp: int, policy: str, algorithm: str
) -> None:
    """A plan with a padding multiple is the plan of the padded piece sizes (pieces cut at
    seq_len, written out here), holding the real tokens: counters, efficiency and padding in
    real tokens, every row's padded size within seq_len."""
    options = PackOptions(
        seq_len=32, pad_to_multiple_of=pad, cp_size=cp, long_docs=policy, algorithm=algorithm
    )
    multiple = options.multiple
    assert multiple == (pad if cp == 1 else int(np.lcm(pad, 2 * cp)))
    p = plan(lengths, replace(options, search_steps=50))
    check_plan(p, lengths, 32, policy)
    pieces = []  # (doc, start, stop) in document order, as the policy cuts them
    for i, n in enumerate(lengths):
        if n > 32 and policy == "drop":
            continue
        stops = [min(n, 32)] if policy == "truncate" else [*range(32, n, 32), n]
        pieces += [(i, a, b) for a, b in zip([0, *stops[:-1]], stops, strict=True)]
    padded = [-(-(b - a) // multiple) * multiple for _, a, b in pieces]
    reference = plan(padded, PackOptions(seq_len=32, algorithm=algorithm, search_steps=50))
    assert [[pieces[i] for i, _, _ in row] for row in reference.bins] == p.bins
    real = sum(b - a for _, a, b in pieces)
    assert p.padding_tokens == sum(padded) - real == p.bin_slots.sum() - p.packed_tokens
    assert p.efficiency == (real / (32 * p.num_bins) if p.num_bins else 0.0)
    assert (p.bin_slots <= 32).all()
    assert p.lower_bound == reference.lower_bound
    assert p.validate() is p


def test_compact_arrays_and_views() -> None:
    p = plan([3, 2, 4, 12], 5)
    arrays = p.to_arrays()
    assert set(arrays) == {"bin_offsets", "doc_index", "start", "stop"}
    assert arrays["bin_offsets"][-1] == len(arrays["doc_index"]) == 6
    assert p.bin(-1).tolist() == [list(s) for s in p.bins[-1]]
    with pytest.raises(IndexError):
        p.bin(p.num_bins)
    with pytest.raises(ValueError, match="read-only"):
        p.slices[0, 0] = 7
    rebuilt = PackPlan.from_bins(p.bins, 5, algorithm="bfd", num_docs=4)
    assert rebuilt.bins == p.bins and rebuilt.lower_bound == p.lower_bound


def test_validate_and_report() -> None:
    bad = PackPlan.from_bins([[(0, 0, 4), (1, 0, 3)]], 5)
    with pytest.raises(ValueError, match="bin 0 holds 7 tokens > seq_len=5"):
        bad.validate()
    report = plan([3, 2, 4, 12], 5, long_docs="drop").report()
    assert "efficiency 90.000%" in report and "1 dropped (12 tokens lost)" in report
    assert "lower bound  2 bins: gap 0 bins" in report


# -- properties ------------------------------------------------------------------------------------
lengths_st = st.lists(st.integers(1, 40), min_size=0, max_size=60)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(1, 24), data=st.data())
def test_invariants_every_algorithm_and_policy(
    lengths: list[int], seq_len: int, data: st.DataObject
) -> None:
    algorithm = data.draw(st.sampled_from(ALGORITHMS))
    policy = data.draw(st.sampled_from([p for p in LONG_DOC_POLICIES if p != "error"]))
    p = plan(lengths, seq_len, algorithm=algorithm, long_docs=policy, seed=3, **FAST)
    check_plan(p, lengths, seq_len, policy)
    assert p.validate() is p
    assert plan(lengths, seq_len, algorithm=algorithm, long_docs=policy, seed=3, **FAST) == p


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), max_size=50), seq_len=st.integers(1, 30))
def test_best_never_uses_more_bins_than_bfd(lengths: list[int], seq_len: int) -> None:
    bfd = plan(lengths, seq_len)
    best = plan(lengths, seq_len, algorithm="best", seed=len(lengths), **FAST)
    assert best.num_bins <= bfd.num_bins
    assert best.lower_bound == bfd.lower_bound <= best.num_bins
    check_plan(best, lengths, seq_len, "split")


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), max_size=80), seq_len=st.integers(1, 50))
def test_greedy_algorithms_match_reference(lengths: list[int], seq_len: int) -> None:
    lengths = [min(n, seq_len) for n in lengths]
    loads = {a: sorted(plan(lengths, seq_len, algorithm=a).bin_loads.tolist()) for a in ALGORITHMS}
    # BFD's bucket moves may break ties between equally full bins differently: same fill levels.
    assert loads["bfd"] == sorted(reference_loads(lengths, seq_len, "best", decreasing=True))
    assert loads["ffd"] == sorted(reference_loads(lengths, seq_len, "first", decreasing=True))
    assert plan(lengths, seq_len, algorithm="first_fit").bin_loads.tolist() == reference_loads(
        lengths, seq_len, "first", decreasing=False
    )
    assert plan(lengths, seq_len, algorithm="next_fit").bin_loads.tolist() == reference_loads(
        lengths, seq_len, "next", decreasing=False
    )
    assert lower_bound(np.array(lengths, dtype=np.int64), seq_len) <= len(loads["bfd"])


def test_bfd_matches_reference_on_many_sizes() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5, 1, 3000), 1, 1024).astype(np.int64)
    ref = reference_loads(lengths.tolist(), 1024, "best", decreasing=True)
    assert sorted(plan(lengths, 1024).bin_loads.tolist()) == sorted(ref)
    assert ref.count(1024) > 10  # ties between full and nearly full bins were exercised


def test_bfd_fills_part_of_a_bucket_then_one_bin_with_the_rest() -> None:
    """Sizes [7, 7, 7, 1, 1, 1, 1], seq_len 10: the 7s open bins 0-2 (3 free each); best fit
    then sends three 1s to bin 0 (the fullest bin that holds one, each time) and the fourth to
    bin 1: two bins of the 3-free bucket are taken, the first whole, the second in part."""
    from megapack.packing.bfd import best_fit_decreasing

    bins = best_fit_decreasing(np.array([7, 7, 7, 1, 1, 1, 1]), 10)
    assert bins.tolist() == [0, 1, 2, 0, 0, 0, 1]
    # the 6s open bins 0 and 1 (2 free); the three 1s: two to bin 0, one to bin 1
    assert best_fit_decreasing(np.array([1, 6, 1, 6, 1]), 8).tolist() == [0, 0, 0, 1, 1]
    assert sorted(plan([7, 7, 7, 1, 1, 1, 1], 10).bin_loads.tolist()) == [7, 8, 10]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([1, 2, 3, 5, 8]), min_size=1, max_size=120),
    seq_len=st.sampled_from([8, 9, 10, 16]),
    algorithm=st.sampled_from(["bfd", "ffd"]),
)
@example(sizes=[1, 1, 1, 1, 2, 3], seq_len=8, algorithm="bfd")  # numpy's default sort swaps 2, 3
@example(sizes=[1, 1, 1, 1, 2, 3], seq_len=8, algorithm="ffd")
def test_greedy_decreasing_places_equal_sizes_in_input_order(
    sizes: list[int], seq_len: int, algorithm: str
) -> None:
    """The decreasing algorithms sort stably: an item's bin depends on its size and its place
    among items of that size, never on how a sort routine orders ties (numpy's default sort
    differs between CPUs, so ranks planning on different machines could disagree)."""
    from megapack.packing.bfd import best_fit_decreasing
    from megapack.packing.fit import first_fit_decreasing

    pack = best_fit_decreasing if algorithm == "bfd" else first_fit_decreasing
    array = np.array(sizes, dtype=np.int64)
    rank = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))  # largest first, ties in order
    presorted = pack(array[rank], seq_len)  # its own sort has nothing to reorder
    assert pack(array, seq_len)[rank].tolist() == presorted.tolist()
    loads = np.bincount(presorted, weights=array[rank]).tolist()
    rule = "best" if algorithm == "bfd" else "first"
    assert sorted(loads) == sorted(reference_loads(sizes, seq_len, rule, decreasing=True))


# -- real data and docs ----------------------------------------------------------------------------
def test_openchat_efficiency_sanity() -> None:
    lengths = json.loads(OPENCHAT.read_text())
    bfd = plan(lengths, 2048)
    assert bfd.efficiency > 0.99 and bfd.lower_bound == 4663
    assert plan(lengths, 2048, algorithm="next_fit").efficiency < bfd.efficiency
    best = plan(lengths, 2048, algorithm="best", search_steps=300)
    assert best.num_bins <= bfd.num_bins - 3  # 4,673 -> 4,670 or better within 300 steps
    check_plan(best, lengths, 2048, "split")


@pytest.mark.parametrize(
    "module",
    ["bounds", "pieces", "bfd", "fit", "subset_sum", "search", "pack_plan", "planner", "streaming"],
)
def test_docstring_examples(module: str) -> None:
    mod = importlib.import_module(f"megapack.packing.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
