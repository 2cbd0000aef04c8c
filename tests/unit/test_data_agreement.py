"""What `PackedDataset` tells the ranks that must agree on it (issue 40): its ``settings()`` for
`megapack.lockstep_steps`' checks, the warning when most of an epoch is filler, and ``iterate``'s
argument checks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from megapack.data import Document, PackedDataset
from megapack.data.resume import identity


def documents(n: int, length: int = 8) -> list[Document]:
    """``n`` documents of ``length`` tokens: with seq_len == length, one row each."""
    return [Document(tokens=np.arange(1, length + 1), loss_mask=np.ones(length, np.float32))] * n


def filler_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "zero-loss filler" in r.getMessage()]


def test_agree_filler_warning_names_the_counts(caplog: pytest.LogCaptureFixture) -> None:
    # the case: 86 rows, micro_batches=1000 on one DP rank -> 914 filler micro-batches
    with caplog.at_level(logging.WARNING, logger="megapack"):
        ds = PackedDataset(documents(86), 8, micro_batches=1000)
    assert len(ds) == 1000
    (record,) = filler_records(caplog)
    assert (record.name, record.levelno) == ("megapack.data", logging.WARNING)
    assert record.getMessage().startswith(
        "megapack: PackedDataset: 914 of the epoch's 1,000 micro-batches (91%) are zero-loss "
        "filler: 86 micro-batches of data padded to whole steps of dp_size 1 x micro_batches "
        "1000 = 1,000. Every filler micro-batch costs"
    )


@pytest.mark.parametrize(
    ("rows", "dp_size", "micro_batches", "warns"),
    [
        (9, 1, 10, False),  # 1 of 10 filler: exactly 10%, no warning
        (8, 1, 10, True),  # 2 of 10: 20%
        (18, 2, 5, False),  # 2 of 20 over 2 DP ranks: 10%
        (17, 2, 5, True),  # 3 of 20: 15%
        (40, 4, 2, False),  # no filler
    ],
)
def test_agree_filler_warning_above_a_tenth_of_the_epoch(
    rows: int, dp_size: int, micro_batches: int, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="megapack"):
        PackedDataset(documents(rows), 8, dp_size=dp_size, micro_batches=micro_batches)
    filler = filler_records(caplog)
    assert bool(filler) == warns, caplog.text
    if warns:
        assert filler[0].pathname == __file__  # it points at the caller's line


def test_agree_filler_warning_on_load_points_at_the_caller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    PackedDataset(documents(5), 8).save(tmp_path / "packed")
    with caplog.at_level(logging.WARNING, logger="megapack"):
        PackedDataset.load(tmp_path / "packed", dp_size=2, micro_batches=4)
    (record,) = filler_records(caplog)
    assert "3 of the epoch's 8 micro-batches (38%)" in record.getMessage()
    assert record.pathname == __file__


def test_agree_settings_hold_the_identity_and_the_dealing() -> None:
    ds = PackedDataset(documents(12), 8, rows_per_micro_batch=2, dp_rank=1, dp_size=2, seed=5,
                       micro_batches=3, loss_fields=True)  # fmt: skip
    settings = ds.settings()
    assert identity(ds).items() <= settings.items()
    assert {k: settings[k] for k in ("rows_per_micro_batch", "dp_rank", "dp_size", "micro_batches",
                                     "loss_fields", "seq_len", "seed", "rows")} == {
        "rows_per_micro_batch": 2, "dp_rank": 1, "dp_size": 2, "micro_batches": 3,
        "loss_fields": True, "seq_len": 8, "seed": 5, "rows": 12}  # fmt: skip
    assert json.loads(json.dumps(settings)) == settings  # plain values: they travel as JSON
    other = PackedDataset(documents(12), 8, rows_per_micro_batch=2, dp_rank=0, dp_size=2, seed=6,
                          micro_batches=3, loss_fields=True)  # fmt: skip
    assert {k for k in settings if settings[k] != other.settings()[k]} == {"dp_rank", "seed"}


def test_agree_iterate_checks_its_arguments() -> None:
    ds = PackedDataset(documents(4), 8)
    with pytest.raises(ValueError, match="group= is used only with lockstep=True"):
        ds.iterate(group=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="iterate: lockstep must be True or False, got 'yes'"):
        ds.iterate(lockstep="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="iterate: repeat must be True or False, got 1"):
        ds.iterate(repeat=1)  # type: ignore[arg-type]
    assert sum(1 for _ in ds.iterate()) == 4
