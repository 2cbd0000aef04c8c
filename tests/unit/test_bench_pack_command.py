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


def row(
    documents: int,
    pack_peak: float,
    tokens: int,
    source: str = "VmHWM",
    anon: float | None = None,
) -> dict[str, object]:
    return {
        "documents": documents, "input_mb": 1.0, "tokens": tokens, "bare_s": 1.0, "pack_s": 1.1,
        "ratio": 1.1, "cpu_ratio": 1.05, "bare_mb_s": 1.0, "pack_mb_s": 0.9, "bare_peak_mib": 40.0,
        "pack_peak_mib": pack_peak, "token_array_mib": tokens * 8 / 2**20, "verdict": "ok",
        "peak_source": source, "bare_anon_mib": None, "pack_anon_mib": anon,
    }  # fmt: skip


def test_markdown_memory_verdict() -> None:
    flat = pack.markdown([row(5_000, 60.0, 1_000_000), row(50_000, 64.0, 10_000_000)])
    assert "| 5,000 | 1.0 | 1,000,000 | 1.00 | 1.10 | 1.10 | 1.05 |" in flat
    assert "each subprocess's own high-water RSS (VmHWM)" in flat
    assert flat.endswith(
        "peak RSS of pack grew 4 MiB for 10x the documents (same lengths), whose extra token ids "
        "alone take 69 MiB (target: under 25% of that): ok\n"
    )
    grows = pack.markdown([row(5_000, 60.0, 1_000_000), row(50_000, 130.0, 10_000_000)])
    assert grows.endswith("GROWS WITH TOKENS\n")
    inherited = pack.markdown([row(5_000, 60.0, 1_000_000, "ru_maxrss")])
    assert "ru_maxrss (no /proc/self/status here)" in inherited


def test_the_memory_check_reads_what_the_pack_allocated_not_the_page_cache() -> None:
    """The 2026-11-28 measurement: 2,000 -> 20,000 documents of the same lengths, VmHWM 80 -> 137
    MiB (the output's page-cache pages the fingerprint maps) but the anonymous peak 52 -> 58 MiB,
    while the extra token ids take 30 MiB. The check once read VmHWM: "GROWS WITH TOKENS"."""
    rows = [row(2_000, 80.0, 437_072, anon=52.0), row(20_000, 137.0, 4_386_520, anon=58.0)]
    check = pack.memory_check(rows)
    assert check is not None and check["measure"] == "anonymous peak" and check["met"]
    assert check["growth_mib"] == 6.0 and round(check["token_growth_mib"]) == 30
    text = pack.markdown(rows)
    assert (
        "| 2,000 | 1.0 | 437,072 | 1.00 | 1.10 | 1.10 | 1.05 | 1.0 | 0.9 | 40 | 80 | 52 | 3 | ok |"
        in text
    )
    assert text.endswith(
        "anonymous peak of pack grew 6 MiB for 10x the documents (same lengths), whose extra "
        "token ids alone take 30 MiB (target: under 25% of that): ok\n"
    )
    rows[1]["pack_anon_mib"] = 60.0  # 8 MiB: more than a quarter of 30
    assert pack.memory_check(rows) == {"measure": "anonymous peak", "growth_mib": 8.0,
                                       "token_growth_mib": rows[1]["token_array_mib"] - rows[0]["token_array_mib"],  # type: ignore[operator]
                                       "documents_ratio": 10.0, "met": False}  # fmt: skip
    assert pack.memory_check(rows[:1]) is None


ALLOCATE = (
    "import json, time\n"
    "import numpy as np\n"
    "kept = np.ones(20_000_000)  # 153 MiB of the child's own\n"
    "time.sleep(0.2)\n"
    "peak, source = peak_rss()\n"
    "print(json.dumps({'peak_mib': peak}))\n"
)
MAP = (
    "import json, sys, time\n"
    "import numpy as np\n"
    "mapped = np.memmap(sys.argv[1], dtype=np.uint8, mode='r')\n"
    "total = int(mapped[::4096].sum())  # touch every page: page cache mapped, nothing allocated\n"
    "time.sleep(0.2)\n"
    "peak, source = peak_rss()\n"
    "print(json.dumps({'peak_mib': peak}))\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon is Linux's")
def test_the_anonymous_peak_counts_allocations_not_mapped_files(tmp_path: Any) -> None:
    own = pack._run(ALLOCATE)
    assert own["anon_peak_mib"] > 140 and own["peak_mib"] > 140
    data = tmp_path / "file.bin"
    data.write_bytes(
        np.random.default_rng(0).integers(0, 255, 96 * 2**20, dtype=np.uint8).tobytes()
    )
    mapped = pack._run(MAP, str(data))
    assert mapped["peak_mib"] > 96  # VmHWM counts the mapped file's pages
    assert mapped["anon_peak_mib"] < 50  # what the child allocated: the interpreter and numpy


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
