"""split_document: worked examples, and a property test against a simple reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.data import ByteTokenizer, Document, split_document
from megapack.data.chat import ChatTemplate


def doc_of(n: int, boundaries: tuple[int, ...] = (), source: str = "f.jsonl:4") -> Document:
    return Document(
        tokens=np.arange(100, 100 + n),
        loss_mask=np.arange(n) % 2,
        boundaries=boundaries,
        source=source,
    )


def test_cuts_at_the_longest_fitting_boundary_prefix() -> None:
    pieces = split_document(doc_of(10, (3, 7)), 5)
    assert [p.tokens.tolist() for p in pieces] == [
        [100, 101, 102],
        [103, 104, 105, 106],
        [107, 108, 109],
    ]
    assert [p.loss_mask.tolist() for p in pieces] == [[0, 1, 0], [1, 0, 1, 0], [1, 0, 1]]
    assert [p.source for p in pieces] == ["f.jsonl:4#part1", "f.jsonl:4#part2", "f.jsonl:4#part3"]


def test_cuts_at_max_len_when_no_boundary_fits_and_keeps_inner_boundaries() -> None:
    assert [len(p) for p in split_document(doc_of(10, (8,)), 5)] == [5, 5]
    pieces = split_document(doc_of(12, (2, 4, 9)), 6)  # longest fitting prefix ends at 4, not 2
    assert [len(p) for p in pieces] == [4, 5, 3]
    assert [p.boundaries for p in pieces] == [(2,), (), ()]
    pieces = split_document(doc_of(12, (2, 7, 9)), 6)  # from 2, boundaries in (2, 8]: 7
    assert [len(p) for p in pieces] == [2, 5, 5]
    assert [p.boundaries for p in pieces] == [(), (), (2,)]


def test_a_document_that_fits_is_returned_unchanged() -> None:
    doc = doc_of(5, (2,))
    assert split_document(doc, 5) == [doc] and split_document(doc, 5)[0] is doc


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_max_len_must_be_a_positive_int(bad: object) -> None:
    wrong_type = not isinstance(bad, int) or isinstance(bad, bool)
    got = f"{type(bad).__name__} {bad!r}" if wrong_type else repr(bad)
    with pytest.raises(
        TypeError if wrong_type else ValueError, match=f"max_len must be an int >= 1, got {got}$"
    ):
        split_document(doc_of(4), bad)  # type: ignore[arg-type]


def test_chat_conversation_splits_between_messages() -> None:
    template, tok = ChatTemplate(), ByteTokenizer()
    tokens, mask, starts = template.render(
        [("user", "hi"), ("assistant", "yo"), ("user", "more"), ("assistant", "ok")], tok
    )
    doc = Document(tokens=tokens, loss_mask=mask, boundaries=starts, source="c.jsonl:1")
    pieces = split_document(doc, 35)  # messages of 13, 18, 15, 18 tokens
    assert [len(p) for p in pieces] == [31, 33]
    assert tok.decode(pieces[1].tokens.tolist()).startswith("<|user|>\nmore")
    assert pieces[1].boundaries == (15,)


def reference_cuts(n: int, boundaries: list[int], max_len: int) -> list[int]:
    """The greedy rule by linear scan: cut points including 0 and n."""
    cuts = [0]
    while n - cuts[-1] > max_len:
        fitting = [b for b in boundaries if cuts[-1] < b <= cuts[-1] + max_len]
        cuts.append(max(fitting) if fitting else cuts[-1] + max_len)
    return [*cuts, n]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 60),
    cut_fraction=st.lists(st.floats(0, 1), max_size=12),
    max_len=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_every_token_kept_once_in_order_with_its_mask(
    n: int, cut_fraction: list[float], max_len: int, seed: int
) -> None:
    boundaries = sorted({int(f * n) for f in cut_fraction} - {0, n})
    rng = np.random.default_rng(seed)
    doc = Document(
        tokens=rng.integers(0, 50_000, n),
        loss_mask=rng.random(n) < 0.5,
        boundaries=tuple(boundaries),
        source="x",
    )
    pieces = split_document(doc, max_len)
    assert np.array_equal(np.concatenate([p.tokens for p in pieces]), doc.tokens)
    assert np.array_equal(np.concatenate([p.loss_mask for p in pieces]), doc.loss_mask)
    assert all(1 <= len(p) <= max_len for p in pieces)
    cuts = reference_cuts(n, boundaries, max_len)
    assert [len(p) for p in pieces] == np.diff(cuts).tolist()
    # Boundaries are kept: each is a cut or lies inside exactly one piece, shifted.
    kept = set(cuts[1:-1]) & set(boundaries)
    for start, piece in zip(cuts, pieces, strict=False):
        kept |= {start + b for b in piece.boundaries}
    assert kept == set(boundaries)
    if len(pieces) > 1:
        assert [p.source for p in pieces] == [f"x#part{k}" for k in range(1, len(pieces) + 1)]
