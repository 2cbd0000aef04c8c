"""Library code logs through the ``megapack`` logger and prints nothing; the CLI prints."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megapack.data import PackedDataset, read_documents


def test_library_logs_and_never_prints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "hello"}\n{"prompt": "no completion"}\n{"text": "' + "x" * 80 + '"}\n')
    with caplog.at_level(logging.DEBUG, logger="megapack"):
        docs = list(read_documents(src, skip_bad=True))
        PackedDataset(docs, 32)
    assert capsys.readouterr() == ("", "")  # nothing on stdout or stderr
    by_logger = {(r.name, r.levelno): r.getMessage() for r in caplog.records}
    skipped = by_logger[("megapack.data.record_reader", logging.DEBUG)]
    assert skipped.startswith(f"skipped {src}:2:") and "completion" in skipped
    assert by_logger[("megapack.data.packed_dir", logging.INFO)].startswith(
        "planned 4 documents into 3 rows of 32 tokens"
    )


def test_megapack_logger_has_a_null_handler() -> None:
    import megapack  # noqa: F401  (its import installs the handler)

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("megapack").handlers)
