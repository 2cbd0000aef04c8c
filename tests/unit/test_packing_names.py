"""Algorithm names and long-document policies: one list read everywhere, one policy implementation."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.cli import build_parser
from megapack.packing import (
    ALGORITHMS,
    LONG_DOC_POLICIES,
    PackOptions,
    StreamingPacker,
    names,
    plan,
)
from megapack.packing.pieces import make_pieces


def test_every_choice_list_reads_the_one_definition() -> None:
    assert (ALGORITHMS, LONG_DOC_POLICIES) == (names.ALGORITHMS, names.LONG_DOC_POLICIES)
    from megapack.packing import balance

    assert balance.BALANCE_MODES is names.BALANCE_MODES
    parser = build_parser()
    pack = next(a for a in parser._actions if a.dest == "command").choices["pack"]  # type: ignore[union-attr]
    choices = {a.dest: tuple(a.choices) for a in pack._actions if a.choices}
    assert (
        choices["algorithm"] == names.ALGORITHMS and choices["long_docs"] == names.LONG_DOC_POLICIES
    )
    for algorithm in names.ALGORITHMS:  # every listed name is accepted
        assert plan([3, 2], 5, algorithm=algorithm, search_steps=100).num_bins == 1


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=25),
    seq_len=st.integers(1, 12),
    policy=st.sampled_from([p for p in names.LONG_DOC_POLICIES if p != "error"]),
)
def test_streaming_long_documents_follow_make_pieces(
    lengths: list[int], seq_len: int, policy: str
) -> None:
    items = make_pieces(np.array(lengths, dtype=np.int64), seq_len, policy)
    packer = StreamingPacker(PackOptions(seq_len=seq_len, long_docs=policy), buffer_size=4)
    pieces = sorted((p.doc_index, p.start, p.stop) for b in packer.pack(lengths) for p in b)
    expected = sorted(
        zip(items.doc_index.tolist(), items.start.tolist(), items.stop.tolist(), strict=True)
    )
    assert pieces == expected
    assert packer.stats["split_docs"] == items.num_split_docs
    assert packer.stats["truncated_tokens"] == items.truncated_tokens
    assert (packer.stats["dropped_docs"], packer.stats["dropped_tokens"]) == (
        items.num_dropped_docs,
        items.dropped_tokens,
    )
