"""The OpenChat lengths ship inside megapack and load by default; explicit files are checked."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

from megapack.bench import datasets
from megapack.bench.datasets import bundled_lengths_path, load_lengths


def test_bundled_openchat_lengths_load_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(datasets.ENV, raising=False)
    monkeypatch.chdir("/")  # nothing relative to the working directory is consulted
    lengths, source = load_lengths()
    assert bundled_lengths_path().is_relative_to(Path(datasets.__file__).parent / "data")
    assert (len(lengths), sum(lengths), max(lengths), min(lengths)) == (6144, 9521300, 2048, 24)
    assert lengths.count(2048) == 3160
    assert "openchat_v1_lengths.json" in source and "synthetic" not in source


def test_explicit_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps([5, 7]))
    monkeypatch.setenv(datasets.ENV, str(mine))
    assert load_lengths()[0] == [5, 7]
    other = tmp_path / "other.json"
    other.write_text(json.dumps([3]))
    assert load_lengths(other)[0] == [3]  # the argument beats the environment


@pytest.mark.parametrize("content", ["[]", "[1, 0]", "[1.5]", '{"a": 1}', "[true]"])
def test_bad_lengths_file_names_file_and_shape(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(
        ValueError, match=r"bad\.json: expected a non-empty JSON list of positive ints"
    ):
        load_lengths(bad)


def test_missing_lengths_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.json.*--lengths"):
        load_lengths(tmp_path / "nope.json")


def test_docstring_example() -> None:
    result = doctest.testmod(datasets)
    assert result.failed == 0 and result.attempted > 0
