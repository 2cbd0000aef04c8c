"""StreamingPacker: the worked example, every token exactly once under each long-document policy,
token-array documents, resuming from a state_dict at any point (the shared save/load contract:
a resumed stream yields exactly what an uninterrupted one would), and clear errors."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.bench.datasets import bundled_lengths_path
from megapack.packing import Piece, StreamingPacker
from megapack.packing import streaming as streaming_module

OPENCHAT = bundled_lengths_path()  # package data: always there, never skipped


def triples(bins: object) -> list[list[tuple[int, int, int]]]:
    return [[(p.position, p.start, p.stop) for p in b] for b in bins]  # type: ignore[attr-defined]


def resumed(make: object, docs: list, k: int) -> tuple[list, list]:
    """Bins of an uninterrupted run, and of a run stopped after k bins then resumed in a new packer."""
    full = triples(make().pack(docs))  # type: ignore[operator]
    first = make()  # type: ignore[operator]
    head = triples(itertools.islice(first.pack(docs), k))
    state = first.state_dict()
    second = make()  # type: ignore[operator]
    second.load_state_dict(state)
    tail = triples(second.pack(itertools.islice(docs, state["consumed"], None)))
    return full, head + tail


def test_worked_example() -> None:
    bins = triples(StreamingPacker(5, buffer_size=4).pack([4, 3, 2, 5, 1, 1]))
    assert bins == [[(3, 0, 5)], [(1, 0, 3), (2, 0, 2)], [(0, 0, 4), (4, 0, 1)], [(5, 0, 1)]]


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), max_size=60),
    capacity=st.integers(1, 20),
    buffer_size=st.integers(1, 12),
    policy=st.sampled_from(["split", "truncate", "drop"]),
)
def test_every_token_once(lengths: list[int], capacity: int, buffer_size: int, policy: str) -> None:
    packer = StreamingPacker(capacity, buffer_size=buffer_size, long_docs=policy)
    bins = list(packer.pack(lengths))
    seen: dict[int, list[tuple[int, int]]] = {}
    for b in bins:
        assert b and sum(p.stop - p.start for p in b) <= capacity
        for p in b:
            assert p.doc == lengths[p.position]
            seen.setdefault(p.position, []).append((p.start, p.stop))
    for i, n in enumerate(lengths):
        if n > capacity and policy == "drop":
            assert i not in seen
            continue
        spans = sorted(seen[i])
        assert spans[0][0] == 0 and spans[-1][1] == (
            min(n, capacity) if policy == "truncate" else n
        )
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert packer.consumed == len(lengths) and packer.stats["bins"] == len(bins)
    long = [n for n in lengths if n > capacity]
    assert packer.stats["dropped_tokens"] == (sum(long) if policy == "drop" else 0)


def test_token_arrays_are_sliced_by_pieces() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, n) for n in rng.integers(1, 40, 50)]
    rebuilt: dict[int, list[tuple[int, np.ndarray]]] = {}
    for b in StreamingPacker(16, buffer_size=8).pack(docs):
        for p in b:
            assert p.doc is docs[p.position]
            rebuilt.setdefault(p.position, []).append((p.start, p.doc[p.start : p.stop]))
    for i, doc in enumerate(docs):
        parts = [tokens for _, tokens in sorted(rebuilt[i], key=lambda x: x[0])]
        assert np.array_equal(np.concatenate(parts), doc)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 25), min_size=1, max_size=50),
    buffer_size=st.integers(1, 10),
    algorithm=st.sampled_from(["bfd", "best", "next_fit"]),
    data=st.data(),
)
def test_resume_equals_uninterrupted(
    lengths: list[int], buffer_size: int, algorithm: str, data: st.DataObject
) -> None:
    def make() -> StreamingPacker:
        return StreamingPacker(
            10, buffer_size=buffer_size, algorithm=algorithm, seed=7, search_steps=50
        )

    total = len(list(make().pack(lengths)))
    k = data.draw(st.integers(0, total))
    full, joined = resumed(make, lengths, k)
    assert joined == full


def test_resume_mid_round_and_after_the_end() -> None:
    lengths = list(np.random.default_rng(1).integers(1, 2048, 700))

    def make() -> StreamingPacker:
        return StreamingPacker(2048, buffer_size=100)

    for k in (0, 1, 37, 200, 10_000):
        full, joined = resumed(make, lengths, k)
        assert joined == full, k
    packer = make()
    gen = packer.pack(lengths)
    next(gen)
    state = packer.state_dict()
    assert state["ready"] and len(state["buffer"]) <= 100 and state["consumed"] > 0


def test_nothing_waits_forever() -> None:
    # A 6 at capacity 10 among 5s never completes a bin; it must still go out within MAX_WAIT_ROUNDS.
    bins = list(StreamingPacker(10, buffer_size=4).pack([6] + [5] * 200))
    where = next(n for n, b in enumerate(bins) if any(p.position == 0 for p in b))
    assert where < streaming_module.MAX_WAIT_ROUNDS * 2 + 2 < len(bins) - 1


def test_errors() -> None:
    with pytest.raises(ValueError, match="document 2 of the stream has 0 tokens"):
        list(StreamingPacker(5).pack([[1], [2, 3], []]))
    with pytest.raises(
        ValueError, match="document 1 of the stream has 9 tokens, more than capacity=5"
    ):
        list(StreamingPacker(5, long_docs="error").pack([3, 9]))
    with pytest.raises(ValueError, match="buffer_size must be an int >= 1"):
        StreamingPacker(5, buffer_size=0)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        StreamingPacker(5, algorithm="magic")
    state = StreamingPacker(5, buffer_size=3).state_dict()
    with pytest.raises(
        ValueError, match="state was saved with buffer_size=3 but this packer has buffer_size=4"
    ):
        StreamingPacker(5, buffer_size=4).load_state_dict(state)
    assert Piece(1, 0, 2, "ab").doc == "ab"


def test_openchat_streaming_efficiency() -> None:
    lengths = json.loads(OPENCHAT.read_text())
    bins = list(StreamingPacker(2048, buffer_size=1000).pack(lengths))
    assert sum(p.stop - p.start for b in bins for p in b) == sum(lengths)
    assert sum(lengths) / (len(bins) * 2048) > 0.99
