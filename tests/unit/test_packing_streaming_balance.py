"""StreamingPacker(balance="compute"): the same bins as the token stream, re-dealt per global batch
(never less balanced), and resumable at any point."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.packing import CostModel, LoadOptions, PackOptions, StreamingPacker
from megapack.packing.balance import imbalance

SQUARES = CostModel(a=1.0, b=1.0)


def triples(bins: object) -> list[tuple[tuple[int, int, int], ...]]:
    return [tuple((p.doc_index, p.start, p.stop) for p in b) for b in bins]  # type: ignore[attr-defined]


WINDOW = 2


def make(dp: int, m: int, r: int, balance: str = "compute") -> StreamingPacker:
    return StreamingPacker(PackOptions(seq_len=32), loading=LoadOptions(balance=balance, dp_size=dp, micro_batches=m, rows_per_micro_batch=r, cost=SQUARES), buffer_size=16, balance_window=WINDOW)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=120),
    dp=st.integers(1, 4),
    m=st.integers(1, 3),
    r=st.integers(1, 2),
    stop=st.integers(0, 40),
)
def test_balance_streaming_same_bins_better_balance_resumable(
    lengths: list[int], dp: int, m: int, r: int, stop: int
) -> None:
    token = triples(make(dp, m, r, "token").pack(lengths))
    compute = triples(make(dp, m, r).pack(lengths))
    assert Counter(compute) == Counter(token)
    group = dp * m * r * WINDOW
    for lo in range(0, len(token), group):  # re-formed within each window only
        assert Counter(compute[lo : lo + group]) == Counter(token[lo : lo + group])
    costs = {b: SQUARES.row_cost([c - a for _, a, c in b]) for b in token}
    deal = LoadOptions(dp_size=dp, micro_batches=m, rows_per_micro_batch=r)
    i_token = imbalance(np.arange(len(token)), np.array([costs[b] for b in token]), deal)
    i_compute = imbalance(np.arange(len(compute)), np.array([costs[b] for b in compute]), deal)
    assert i_compute <= i_token + 1e-9
    # stop after `stop` bins, resume in a new packer: the same stream
    first = make(dp, m, r)
    head = triples(itertools.islice(first.pack(lengths), stop))
    state = first.state_dict()
    second = make(dp, m, r)
    second.load_state_dict(state)
    tail = triples(second.pack(itertools.islice(lengths, state["consumed"], None)))
    assert head + tail == compute


def test_balance_streaming_settings_must_match_on_resume() -> None:
    state = make(2, 2, 1).state_dict()
    with pytest.raises(ValueError, match="dp_size=2"):
        make(4, 2, 1).load_state_dict(state)


def test_balance_streaming_bad_arguments() -> None:
    with pytest.raises(TypeError, match="needs cost=CostModel"):
        StreamingPacker(PackOptions(seq_len=32), loading=LoadOptions(balance="compute"))
    with pytest.raises(ValueError, match="balance must be one of"):
        StreamingPacker(PackOptions(seq_len=32), loading=LoadOptions(balance="flops"))
    with pytest.raises(ValueError, match=r"^balance_window must be an int >= 1, got 0$"):
        StreamingPacker(32, balance_window=0)


def test_balance_streaming_openchat_window() -> None:
    from megapack.bench.datasets import load_lengths

    lengths, _ = load_lengths()  # the OpenChat V1 lengths bundled with the package
    cost = CostModel(a=0, b=1)
    layout = {"dp_size": 8, "micro_batches": 4}
    result = {}
    for mode in ("token", "compute"):
        deal = LoadOptions(balance=mode, cost=cost, **layout)
        bins = list(StreamingPacker(2048, loading=deal).pack(lengths))
        costs = np.array([cost.row_cost([p.stop - p.start for p in b]) for b in bins])
        result[mode] = imbalance(np.arange(len(bins)), costs, deal)
    assert result["compute"] < 1.01 < result["token"], result
