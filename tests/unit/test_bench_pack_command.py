"""The bench's ``pack`` section: honest peak memory, the same starting line, the table."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import numpy as np
import pytest

from megapack.bench import pack_command as pack

CHILD = (
    "import json, resource\n"
    "peak, source = peak_rss()\n"
    "print(json.dumps({'peak_mib': peak, 'source': source,\n"
    "                  'ru_maxrss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_peak_rss_is_the_childs_own_not_the_big_parents() -> None:
    big = np.ones(40_000_000)  # 305 MiB touched in this (parent) process
    parent_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert parent_mib > 300
    child = pack._run(CHILD)
    del big
    # ru_maxrss carries the parent's high-water mark across fork + exec: what the bench once read
    assert child["ru_maxrss_mib"] > 300
    assert child["source"] == "VmHWM"
    assert 1 < child["peak_mib"] < 100  # a bare interpreter, whatever the parent holds


def test_peak_rss_falls_back_to_ru_maxrss_without_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    space: dict[str, object] = {}
    exec(pack.PEAK, space)

    def no_proc(*args: object, **kwargs: object) -> None:
        raise OSError("no /proc here")

    space["open"] = no_proc
    peak, source = space["peak_rss"]()  # type: ignore[operator]
    assert source == "ru_maxrss"
    unit = 1 if sys.platform == "darwin" else 1024
    expected = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**20
    assert peak == pytest.approx(expected, rel=0.05)


def test_both_timers_start_before_loading_the_tokenizer() -> None:
    """Same starting line: the pack loads its tokenizer inside cli.main, so bare must time it too."""
    assert pack.BARE.index("start = time.perf_counter()") < pack.BARE.index("Tokenizer.from_file")
    assert pack.PACK.index("start = time.perf_counter()") < pack.PACK.index("megapack.cli.main(")
    for script in (pack.BARE, pack.PACK):  # the peak is read in the child, never ru_maxrss
        assert "peak_rss()" in script and "ru_maxrss" not in script


def test_run_pack_small_inputs_side_by_side() -> None:
    rows = pack.run_pack([30, 300])
    assert [r["documents"] for r in rows] == [30, 300]
    for r in rows:
        assert r["tokens"] > r["documents"] * 40  # 40-400 words a document
        assert r["bare_s"] > 0 and r["pack_s"] > 0
        assert r["ratio"] == pytest.approx(r["pack_s"] / r["bare_s"]) and r["cpu_ratio"] > 0
        assert r["verdict"] == ("ok" if r["ratio"] <= pack.TARGET_RATIO else "SLOW")
        if sys.platform.startswith("linux"):
            assert r["peak_source"] == "VmHWM"
            assert 1 < r["bare_peak_mib"] < r["pack_peak_mib"]  # the pack imports numpy and more


def row(documents: int, pack_peak: float, tokens: int, source: str = "VmHWM") -> dict[str, object]:
    return {
        "documents": documents, "input_mb": 1.0, "tokens": tokens, "bare_s": 1.0, "pack_s": 1.1,
        "ratio": 1.1, "cpu_ratio": 1.05, "bare_mb_s": 1.0, "pack_mb_s": 0.9, "bare_peak_mib": 40.0,
        "pack_peak_mib": pack_peak, "token_array_mib": tokens * 8 / 2**20, "verdict": "ok",
        "peak_source": source,
    }  # fmt: skip


def test_markdown_memory_verdict() -> None:
    flat = pack.markdown([row(5_000, 60.0, 1_000_000), row(50_000, 64.0, 10_000_000)])
    assert "| 5,000 | 1.0 | 1,000,000 | 1.00 | 1.10 | 1.10 | 1.05 |" in flat
    assert "each subprocess's own high-water RSS (VmHWM)" in flat
    assert "peak RSS of pack grew 4 MiB for 10x the input" in flat and flat.endswith(": ok\n")
    grows = pack.markdown([row(5_000, 60.0, 1_000_000), row(50_000, 130.0, 10_000_000)])
    assert grows.endswith("GROWS WITH TOKENS\n")
    inherited = pack.markdown([row(5_000, 60.0, 1_000_000, "ru_maxrss")])
    assert "ru_maxrss (no /proc/self/status here)" in inherited


def test_cpu_seconds_resolves_a_millisecond() -> None:
    """A small corpus's bare loop takes a few ms of CPU: a 10 ms tick clock read 0 (and the CPU
    ratio divided by it)."""
    scope: dict[str, Any] = {}
    exec(pack.PEAK, scope)
    spans = []
    for _ in range(5):
        before = scope["cpu_seconds"]()
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass
        spans.append(scope["cpu_seconds"]() - before)
    assert all(0 < s < 0.009 for s in spans), spans  # a tick clock gives 0.0 or 0.01
