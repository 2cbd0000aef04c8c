"""StreamingPacker: the worked example, every token exactly once under each long-document policy,
token-array documents, resuming from a state_dict at any point (the shared save/load contract:
a resumed stream yields exactly what an uninterrupted one would), and clear errors."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapack.bench.datasets import bundled_lengths_path
from megapack.packing import CostModel, LoadOptions, PackOptions, Piece, StreamingPacker, plan
from megapack.packing import streaming as streaming_module

OPENCHAT = bundled_lengths_path()  # package data: always there, never skipped


def triples(bins: object) -> list[list[tuple[int, int, int]]]:
    return [[(p.doc_index, p.start, p.stop) for p in b] for b in bins]  # type: ignore[attr-defined]


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
    seq_len=st.integers(1, 20),
    buffer_size=st.integers(1, 12),
    policy=st.sampled_from(["split", "truncate", "drop"]),
)
def test_every_token_once(lengths: list[int], seq_len: int, buffer_size: int, policy: str) -> None:
    packer = StreamingPacker(
        PackOptions(seq_len=seq_len, long_docs=policy), buffer_size=buffer_size
    )
    bins = list(packer.pack(lengths))
    seen: dict[int, list[tuple[int, int]]] = {}
    for b in bins:
        assert b and sum(p.stop - p.start for p in b) <= seq_len
        for p in b:
            assert p.doc == lengths[p.doc_index]
            seen.setdefault(p.doc_index, []).append((p.start, p.stop))
    for i, n in enumerate(lengths):
        if n > seq_len and policy == "drop":
            assert i not in seen
            continue
        spans = sorted(seen[i])
        assert spans[0][0] == 0 and spans[-1][1] == (min(n, seq_len) if policy == "truncate" else n)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert packer.consumed == len(lengths) and packer.stats["bins"] == len(bins)
    long = [n for n in lengths if n > seq_len]
    assert packer.stats["dropped_tokens"] == (sum(long) if policy == "drop" else 0)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    pad=st.sampled_from([1, 2, 4]),
    cp=st.sampled_from([1, 2]),
)
def test_pieces_take_their_padded_size_in_a_bin(lengths: list[int], pad: int, cp: int) -> None:
    """Every setting comes from the `PackOptions`: each piece takes ``ceil(size / multiple) *
    multiple`` slots of its bin, as in ``plan()``; one round (the whole stream in the buffer)
    is that plan's bins."""
    options = PackOptions(seq_len=16, pad_to_multiple_of=pad, cp_size=cp)
    m = options.multiple
    bins = list(StreamingPacker(options, buffer_size=4).pack(lengths))
    assert all(sum(-(-(p.stop - p.start) // m) * m for p in b) <= 16 for b in bins)
    spans = sorted((p.doc_index, p.start, p.stop) for b in bins for p in b)
    assert spans == sorted(t for row in plan(lengths, options).bins for t in row)
    whole = StreamingPacker(options, buffer_size=len(lengths) * 3)
    assert (
        triples(whole.pack(lengths)) == plan(lengths, replace(options, seed=round_seed(0, 0))).bins
    )


def round_seed(seed: int, k: int) -> int:
    return int(np.random.SeedSequence([seed, k]).generate_state(1)[0])


def test_token_arrays_are_sliced_by_pieces() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, n) for n in rng.integers(1, 40, 50)]
    rebuilt: dict[int, list[tuple[int, np.ndarray]]] = {}
    for b in StreamingPacker(16, buffer_size=8).pack(docs):
        for p in b:
            assert p.doc is docs[p.doc_index]
            rebuilt.setdefault(p.doc_index, []).append((p.start, p.doc[p.start : p.stop]))
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
            PackOptions(seq_len=10, algorithm=algorithm, seed=7, search_steps=50),
            buffer_size=buffer_size,
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
    # A 6 at seq_len 10 among 5s never completes a bin; it must still go out within MAX_WAIT_ROUNDS.
    bins = list(StreamingPacker(10, buffer_size=4).pack([6] + [5] * 200))
    where = next(n for n, b in enumerate(bins) if any(p.doc_index == 0 for p in b))
    assert where < streaming_module.MAX_WAIT_ROUNDS * 2 + 2 < len(bins) - 1


def test_errors() -> None:
    with pytest.raises(ValueError, match="document 2 of the stream has 0 tokens"):
        list(StreamingPacker(5).pack([[1], [2, 3], []]))
    with pytest.raises(
        ValueError, match="document 1 of the stream has 9 tokens, more than seq_len=5"
    ):
        list(StreamingPacker(PackOptions(seq_len=5, long_docs="error")).pack([3, 9]))
    with pytest.raises(ValueError, match="buffer_size must be an int >= 1"):
        StreamingPacker(5, buffer_size=0)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        StreamingPacker(PackOptions(seq_len=5, algorithm="magic"))
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


def test_state_dict_records_every_setting_and_the_progress() -> None:
    """A saved state is read back by later runs: its keys and the defaults they record are part
    of the format. The worked example takes two rounds and yields 15 tokens in 4 bins."""
    packer = StreamingPacker(5, buffer_size=4)
    assert [len(b) for b in packer.pack([4, 3, 2, 5, 1, 1])] == [1, 2, 2, 1]
    state = packer.state_dict()
    assert state["config"] == {
        "seq_len": 5, "algorithm": "bfd", "long_docs": "split", "pad_to_multiple_of": 1,
        "cp_size": 1, "max_documents": None, "seed": 0, "search_steps": 20_000,
        "buffer_size": 4, "balance_window": 8, "balance": "token", "dp_size": 1,
        "micro_batches": 1, "rows_per_micro_batch": 1, "cost": None,
    }  # fmt: skip
    assert StreamingPacker(5).state_dict()["config"]["buffer_size"] == 1000
    assert (state["version"], state["consumed"], state["rounds"]) == (2, 6, 2)
    assert (state["buffer"], state["ready"], state["ordered"]) == ([], [], 0)
    assert state["stats"] == {
        "bins": 4, "tokens": 16, "split_docs": 0, "truncated_tokens": 0, "dropped_docs": 0,
        "dropped_tokens": 0,
    }  # fmt: skip
    cost = CostModel(a=1, b=2)
    balanced = StreamingPacker(
        PackOptions(seq_len=5),
        loading=LoadOptions(balance="compute", cost=cost, dp_size=2),
        balance_window=3,
    )
    assert {k: balanced.state_dict()["config"][k] for k in ("balance", "cost", "dp_size")} == {
        "balance": "compute", "cost": [1.0, 2.0], "dp_size": 2,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"^state version 99 != 2$"):
        StreamingPacker(5).load_state_dict({"version": 99})


def test_each_round_plans_with_its_own_seed() -> None:
    """Round ``k`` of "best" plans with seed ``SeedSequence([seed, k])`` and the step budget: one
    round (the whole stream fits the buffer) is that plan of the lengths."""
    lengths = [18, 17, 20, 32, 33, 25, 28, 38, 25, 15, 4, 22, 10, 24, 2, 34, 37, 6, 32, 16, 2,
               36, 37, 2, 24, 33, 31, 17, 34, 33]  # fmt: skip
    for seed in (0, 5):
        packer = StreamingPacker(
            PackOptions(seq_len=64, algorithm="best", seed=seed, search_steps=300), buffer_size=100
        )
        got = [[p.doc_index for p in b] for b in packer.pack(lengths)]
        round_seed = int(np.random.SeedSequence([seed, 0]).generate_state(1)[0])
        want = plan(lengths, 64, algorithm="best", seed=round_seed, search_steps=300)
        assert got == [[d for d, _, _ in b] for b in want.bins]
    assert StreamingPacker(PackOptions(seq_len=5, search_steps=0)).packing.search_steps == 0


def test_bins_at_least_99_percent_full_go_out_at_once() -> None:
    """Capacity 100, buffer 2: round 1 plans [100] and [99]; 99 is 99% full, so both go out, and
    the last document (1 token) gets a bin of its own."""
    bins = list(StreamingPacker(100, buffer_size=2).pack([99, 100, 1]))
    assert triples(bins) == [[(1, 0, 100)], [(0, 0, 99)], [(2, 0, 1)]]


def test_the_emptiest_bins_wait_for_more_documents() -> None:
    """Buffer 4 (half of it, 2 pieces, may wait): round 1 plans 80 | 70 | 60 | 50; the two
    emptiest wait, 80 and 70 go out; at the end 60 and 50 go out."""
    bins = list(StreamingPacker(100, buffer_size=4).pack([60, 50, 70, 80]))
    assert triples(bins) == [[(3, 0, 80)], [(2, 0, 70)], [(0, 0, 60)], [(1, 0, 50)]]


def test_a_piece_waits_at_most_max_wait_rounds() -> None:
    """A 10 among documents of 100 never fills its bin; round ``k`` emits document ``k``, and in
    round 8 the 10 (there since round 0) has waited `MAX_WAIT_ROUNDS` rounds and goes out too."""
    bins = triples(StreamingPacker(100, buffer_size=2).pack([10] + [100] * 12))
    assert streaming_module.MAX_WAIT_ROUNDS == 8
    assert bins[:10] == [*[[(k, 0, 100)] for k in range(1, 9)], [(0, 0, 10)], [(9, 0, 100)]]


def test_bad_settings_are_named() -> None:
    for value, error in ((True, TypeError), (5.0, TypeError), (0, ValueError)):
        with pytest.raises(error, match=r"^seq_len must be an int >= 1, got (bool |float )?"):
            StreamingPacker(value)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^StreamingPacker\(loading=\.\.\.\): expected LoadOptions"
    ):
        StreamingPacker(5, loading={"dp_size": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^long_docs must be one of \('split', .*got 'fold'$"):
        StreamingPacker(PackOptions(seq_len=5, long_docs="fold"))


def test_a_state_saved_before_ordered_existed_resumes() -> None:
    """States without "ordered" (older ones) resume as if no bin were already ordered."""
    lengths = list(np.random.default_rng(3).integers(1, 30, 80))
    cost = CostModel(a=1, b=1)

    def make() -> StreamingPacker:
        return StreamingPacker(PackOptions(seq_len=32), loading=LoadOptions(balance="compute", dp_size=2, cost=cost), buffer_size=16, balance_window=2)  # fmt: skip

    full = triples(make().pack(lengths))
    first = make()
    head = triples(itertools.islice(first.pack(lengths), 8))  # two whole windows of 2 x 2 bins
    state = first.state_dict()
    assert state["ordered"] == 0 and state["ready"]
    del state["ordered"]
    second = make()
    second.load_state_dict(state)
    assert head + triples(second.pack(lengths[state["consumed"] :])) == full


def test_compute_windows_are_dealt_with_the_seed_and_the_bins_so_far() -> None:
    """Each window is `compute_order` of its bins with seed ``(seed, bins yielded before it)``."""
    from megapack.packing.balance import compute_order

    lengths = list(np.random.default_rng(4).integers(1, 30, 40))
    cost = CostModel(a=1, b=1)
    deal = LoadOptions(balance="compute", cost=cost, dp_size=2, micro_batches=2)
    plain = StreamingPacker(32, buffer_size=100)
    window = list(plain.pack(lengths))  # one round, fewer bins than one window of 8 x 4
    for seed in (0, 3):
        packer = StreamingPacker(PackOptions(seq_len=32, seed=seed), loading=deal, buffer_size=100)
        costs = np.array([cost.row_cost([p.stop - p.start for p in b]) for b in window])
        order = compute_order(np.arange(len(window)), costs, deal, seed=(seed, 0))
        assert triples(packer.pack(lengths)) == triples([window[i] for i in order])


def test_each_round_calls_plan_with_its_seed_and_the_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The module's determinism promise, checked where it is made: round ``k`` plans its pieces
    with the packer's options but seed ``SeedSequence([seed, k])`` and "error" for long pieces
    (they were cut to the seq_len on the way in)."""
    calls: list[PackOptions] = []
    real = streaming_module.plan

    def spy(lengths: object, packing: PackOptions, **kw: object) -> object:
        assert not kw
        calls.append(packing)
        return real(lengths, packing)  # type: ignore[arg-type]

    monkeypatch.setattr(streaming_module, "plan", spy)
    options = PackOptions(seq_len=10, algorithm="best", seed=7, search_steps=40, max_documents=3)
    packer = StreamingPacker(options, buffer_size=3)
    list(packer.pack([4, 3, 12, 5, 6, 2, 2]))
    assert len(calls) == packer.rounds >= 3
    for k, packing in enumerate(calls):
        seed = int(np.random.SeedSequence([7, k]).generate_state(1)[0])
        assert packing == replace(options, long_docs="error", seed=seed)


def saved_mid_stream() -> tuple[StreamingPacker, dict]:
    """A packer 3 bins into a stream, with pieces buffered and bins ready, and its state as saved."""
    lengths = np.random.default_rng(5).integers(1, 30, 80).tolist()
    packer = StreamingPacker(32, buffer_size=16)
    list(itertools.islice(packer.pack(lengths), 3))
    state = json.loads(json.dumps(packer.state_dict()))
    assert state["buffer"] and state["ready"]
    return packer, state


@pytest.mark.parametrize("key", ["config", "consumed", "rounds", "buffer", "ready", "stats"])
def test_streaming_resume_refuses_a_state_missing_a_key_on_load(key: str) -> None:
    _, state = saved_mid_stream()
    del state[key]
    fresh = StreamingPacker(32, buffer_size=16)
    with pytest.raises(ValueError, match=rf"the state has no '{key}' \(keys \["):
        fresh.load_state_dict(state)
    assert (fresh.consumed, fresh.rounds, fresh.stats["bins"]) == (0, 0, 0)  # nothing changed


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda s: s.update(consumed=-1), ValueError, r"state\['consumed'\] must be an int >= 0, got -1"),
        (lambda s: s.update(rounds="2"), TypeError, r"state\['rounds'\] must be an int >= 0, got str '2'"),
        (lambda s: s.update(ordered=99), ValueError, r"state\['ordered'\]=99: more bins in balanced order than the \d+ ready"),
        (lambda s: s.update(ordered=-1), ValueError, r"state\['ordered'\] must be an int >= 0, got -1"),
        (lambda s: s.update(buffer={}), TypeError, r"state\['buffer'\] must be a list, got dict \{\}"),
        (lambda s: s.update(ready=None), TypeError, r"state\['ready'\] must be a list of bins, got NoneType"),
        (lambda s: s.update(stats=[]), TypeError, r"state\['stats'\] must be a dict of counters, got list"),
        (lambda s: s.update(config=3), TypeError, r"state\['config'\] must be a dict of settings, got int 3"),
        (lambda s: s["stats"].pop("tokens"), ValueError, r"state\['stats'\] has no 'tokens'"),
        (lambda s: s["stats"].update(bins=-5), ValueError, r"state\['stats'\]\['bins'\] must be an int >= 0, got -5"),
        (lambda s: s["buffer"].__setitem__(0, [1, 2, 3]), TypeError, r"state\['buffer'\]\[0\] must be a pair \(piece, round\)"),
        (lambda s: s["buffer"][0].__setitem__(1, 99), ValueError, r"state\['buffer'\]\[0\]\[1\]=99: a piece arrived in round 99 but the state has planned only \d+ rounds"),
        (lambda s: s["buffer"][0][0].__setitem__(0, 10_000), ValueError, r"state\['buffer'\]\[0\]\[0\] is of document 10000, but the state has read only \d+ documents"),
        (lambda s: s["ready"][0][0].__setitem__(2, 99), ValueError, r"state\['ready'\]\[0\]\[0\] holds tokens 0:99; a piece holds 1 to seq_len=32 tokens"),
        (lambda s: s["ready"][0][0].__setitem__(1, -1), ValueError, r"state\['ready'\]\[0\]\[0\]\[1\] must be an int >= 0, got -1"),
        (lambda s: s["ready"].__setitem__(0, []), TypeError, r"state\['ready'\]\[0\] must be a non-empty list of pieces"),
        (lambda s: s["ready"][0].__setitem__(0, [1, 2]), TypeError, r"state\['ready'\]\[0\]\[0\] must be a piece \(doc_index, start, stop, doc\)"),
        (lambda s: s["config"].pop("seq_len"), ValueError, r"state was saved with seq_len=None but this packer has seq_len=32"),
    ],
)  # fmt: skip
def test_streaming_resume_refuses_a_malformed_state_on_load(
    change: Any, error: type[Exception], message: str
) -> None:
    _, state = saved_mid_stream()
    change(state)
    fresh = StreamingPacker(32, buffer_size=16)
    with pytest.raises(error, match=message):
        fresh.load_state_dict(state)
    assert (fresh.consumed, fresh.rounds, list(fresh._ready)) == (0, 0, [])
    with pytest.raises(TypeError, match=r"a StreamingPacker state is a dict .*, got str 'x'"):
        fresh.load_state_dict("x")  # type: ignore[arg-type]


def test_streaming_resume_from_a_json_round_trip_is_exact() -> None:
    """A state as saved (JSON: tuples become lists) resumes to the same bins."""
    lengths = np.random.default_rng(5).integers(1, 30, 80).tolist()
    full = triples(StreamingPacker(32, buffer_size=16).pack(lengths))
    packer, state = saved_mid_stream()
    again = StreamingPacker(32, buffer_size=16)
    again.load_state_dict(state)
    assert again.stats == packer.stats and again.consumed == packer.consumed
    assert full[:3] + triples(again.pack(lengths[state["consumed"] :])) == full
