"""Algorithm names and long-document policies: one list read everywhere, one policy implementation."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.cli import build_parser
from megapack.data import dataset
from megapack.packing import ALGORITHMS, LONG_DOC_POLICIES, StreamingPacker, names, plan
from megapack.packing.pieces import make_items


def test_every_choice_list_reads_the_one_definition() -> None:
    assert (ALGORITHMS, LONG_DOC_POLICIES) == (names.ALGORITHMS, names.LONG_DOC_POLICIES)
    assert dataset.LONG_DOCS is names.LONG_DOC_POLICIES
    from megapack.packing import balance, streaming

    assert balance.BALANCE_MODES is streaming.BALANCE_MODES is names.BALANCE_MODES
    parser = build_parser()
    pack = next(a for a in parser._actions if a.dest == "command").choices["pack"]  # type: ignore[union-attr]
    choices = {a.dest: tuple(a.choices) for a in pack._actions if a.choices}
    assert (
        choices["algorithm"] == names.ALGORITHMS and choices["long_docs"] == names.LONG_DOC_POLICIES
    )
    for algorithm in names.ALGORITHMS:  # every listed name is accepted
        assert plan([3, 2], 5, algorithm=algorithm, time_limit_s=1.0).num_bins == 1


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=25),
    capacity=st.integers(1, 12),
    policy=st.sampled_from([p for p in names.LONG_DOC_POLICIES if p != "error"]),
)
def test_streaming_long_documents_follow_make_items(
    lengths: list[int], capacity: int, policy: str
) -> None:
    items = make_items(np.array(lengths, dtype=np.int64), capacity, policy)
    packer = StreamingPacker(capacity, buffer_size=4, long_docs=policy)
    pieces = sorted((p.position, p.start, p.stop) for b in packer.pack(lengths) for p in b)
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
