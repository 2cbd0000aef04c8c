"""`megapack.data.fingerprint`: a packed dataset's identity, as checkpoints record it.

(`tests/unit/test_data_packed_dir.py` checks what changes it: document lengths, the packing, the
sampled tokens and loss mask; this file checks that it is stable: the same value for the same
values whatever the arrays' storage dtype, the same value across megapack releases of one scheme,
and which token positions it reads.)
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from megapack.data.fingerprint import PREFIX, SAMPLES, WINDOW, fingerprint, sample_positions


def small() -> dict[str, np.ndarray]:
    """Three documents (3, 2 and 2 tokens) in two rows of at most 5 tokens."""
    return {
        "tokens": np.array([5, 9, 2, 7, 7, 1, 3]),
        "loss_mask": np.array([0, 1, 1, 1, 0, 1, 1], np.float32),
        "doc_offsets": np.array([0, 3, 5, 7]),
        "slices": np.array([[0, 0, 3], [2, 0, 2], [1, 0, 2]]),
        "bin_offsets": np.array([0, 2, 3]),
    }


SMALL_FINGERPRINT = "blake2b-128:3cf17913047b896957206affbda20c7d"
"""`small()`'s fingerprint as megapack has recorded it in ``meta.json`` and in every
``DatasetIterator.state_dict()`` since fingerprints exist (state version 2). A change here makes
every saved checkpoint refuse to resume on its own dataset: change the scheme only with a new
`PREFIX` (``blake2b-128:`` names this one) and a reader of the old one."""


def test_the_fingerprint_of_a_dataset_does_not_change_across_releases() -> None:
    fp = fingerprint(small())
    assert fp == SMALL_FINGERPRINT
    # its form: the scheme's name, then 128 bits as 32 lower-case hex digits
    assert re.fullmatch(re.escape(PREFIX) + "[0-9a-f]{32}", fp), fp


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("tokens", np.int32),  # token ids stored narrower than in memory
        ("tokens", np.uint16),
        ("loss_mask", np.bool_),  # a 0/1 mask of another dtype
        ("loss_mask", np.float64),
        ("doc_offsets", np.int32),
        ("slices", np.int32),
        ("bin_offsets", np.uint32),
    ],
)
def test_the_same_values_in_another_dtype_have_the_same_fingerprint(name: str, dtype: type) -> None:
    """A dataset read back from files (memory-mapped, any integer width) is the same dataset as
    the one in memory that wrote them: the fingerprint hashes values, not their storage."""
    arrays = small()
    stored = arrays | {name: arrays[name].astype(dtype)}
    assert stored[name].dtype != arrays[name].dtype
    assert fingerprint(stored) == fingerprint(arrays)


@pytest.mark.parametrize("count", [0, 1, 5, 33, 1000, SAMPLES * WINDOW - 1, SAMPLES * WINDOW])
def test_up_to_samples_times_window_tokens_every_token_is_read(count: int) -> None:
    assert sample_positions(count).tolist() == list(range(count))


@pytest.mark.parametrize("count", [SAMPLES * WINDOW + 1, 10_000, 1_000_003])
def test_past_samples_times_window_evenly_spaced_windows_first_to_last_token(count: int) -> None:
    picked = sample_positions(count)
    assert picked.dtype == np.int64 and len(picked) == SAMPLES * WINDOW
    windows = picked.reshape(SAMPLES, WINDOW)
    # each window is WINDOW consecutive positions; the windows rise and do not overlap
    assert (np.diff(windows, axis=1) == 1).all()
    assert (np.diff(windows[:, 0]) >= WINDOW).all()
    assert windows[0, 0] == 0 and windows[-1, -1] == count - 1
    # evenly spaced: every gap between window starts within one token of the mean gap
    gaps = np.diff(windows[:, 0])
    assert gaps.max() - gaps.min() <= 1


def test_a_change_of_any_token_of_a_small_dataset_changes_the_fingerprint() -> None:
    """At most SAMPLES x WINDOW tokens, every token counts."""
    rng = np.random.default_rng(5)
    total = 1000
    arrays = small() | {
        "tokens": rng.integers(0, 1000, total),
        "loss_mask": np.ones(total, np.float32),
        "doc_offsets": np.array([0, 400, total]),
        "slices": np.array([[0, 0, 400], [1, 0, 600]]),
        "bin_offsets": np.array([0, 1, 2]),
    }
    base = fingerprint(arrays)
    for position in (0, 1, 77, 500, total - 1):
        changed = arrays["tokens"].copy()
        changed[position] += 1
        assert fingerprint(arrays | {"tokens": changed}) != base, position
