"""Library code logs through the ``megapack`` logger and prints nothing; the CLI prints."""

from __future__ import annotations

import logging
import subprocess
import sys
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


SCRIPT = """
import logging, sys
import numpy as np
import megapack
from megapack.data import Document, PackedDataset
if sys.argv[1] == "configured":
    logging.basicConfig(format="APP %(name)s %(levelname)s %(message)s", level=logging.INFO)
docs = [Document(tokens=np.arange(1, 9), loss_mask=np.ones(8, np.float32))] * 3
PackedDataset(docs, 8, micro_batches=10)  # INFO: planned ...; WARNING: 7 of 10 are filler
"""
FILLER = (
    "megapack: PackedDataset: 7 of the epoch's 10 micro-batches (70%) are zero-loss filler: 3 "
    "micro-batches of data padded to whole steps of dp_size 1 x micro_batches 10 = 10. Every "
    "filler micro-batch costs a forward and backward and trains nothing: use fewer micro-batches "
    "a step or fewer DP ranks for this data, or more data"
)


def run_script(mode: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_megapack_warnings_reach_stderr_when_nothing_is_configured() -> None:
    # No NullHandler: Python's last-resort handler prints WARNING and above (the message alone,
    # hence the "megapack: " prefix), and nothing at INFO
    done = run_script("bare")
    assert (done.stdout, done.stderr) == ("", FILLER + "\n")


def test_megapack_logs_through_the_applications_own_handlers() -> None:
    done = run_script("configured")
    lines = done.stderr.splitlines()
    assert f"APP megapack.data WARNING {FILLER}" in lines, done.stderr
    assert any(line.startswith("APP megapack.data.packed_dir INFO planned 3 documents into 3 rows") for line in lines), done.stderr  # fmt: skip
    assert done.stdout == ""


def test_megapack_adds_no_handler_of_its_own() -> None:
    import megapack  # noqa: F401

    assert logging.getLogger("megapack").handlers == []
