"""`megapack bench`'s choice of packing's CPU attention backend: measured, said, the same on every
rank; with or without the ``bucketed`` backend in `megapack.attention.BACKENDS`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import megapack.attention as attention
from megapack.attention import PackedAttention
from megapack.bench import throughput
from megapack.bench.throughput import choose_cpu_backend, cpu_candidates, set_attention_backend

CONFIG = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=8, attention_dropout=0.0,
                         context_parallel_size=1, window_size=None, softmax_type="vanilla")  # fmt: skip
TP1 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))


def model() -> torch.nn.Module:
    layers = [PackedAttention(CONFIG, i, None, "self", pg_collection=TP1) for i in (1, 2)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(2, 2))


def backends(m: torch.nn.Module) -> list[str]:
    return [x.backend for x in m.modules() if isinstance(x, PackedAttention)]


def test_set_attention_backend_sets_every_layer() -> None:
    m = model()
    assert backends(m) == ["auto", "auto"]
    assert set_attention_backend(m, "sdpa") == 2 and backends(m) == ["sdpa", "sdpa"]
    with pytest.raises(ValueError, match="backend='nope'; choose one of"):
        set_attention_backend(m, "nope")


def test_candidates_before_and_after_the_bucketed_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "BACKENDS", ("flex", "sdpa"))
    assert cpu_candidates() == (["sdpa"], "bucketed is not in megapack.attention.BACKENDS")
    monkeypatch.setattr(attention, "BACKENDS", ("bucketed", "sdpa"))
    monkeypatch.setattr(
        attention, "backend_available", lambda name, device, training: name == "sdpa"
    )
    assert cpu_candidates() == (["sdpa"], "bucketed cannot train on CPU here")
    monkeypatch.setattr(attention, "backend_available", lambda name, device, training: True)
    assert cpu_candidates() == (["sdpa", "bucketed"], "")


def test_the_faster_candidate_is_chosen_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    m = model()
    monkeypatch.setattr(
        throughput, "set_attention_backend", lambda mod, name: calls.append(name) or 2
    )
    seconds = {"sdpa": [0.9, 0.5], "bucketed": [0.8, 0.3]}  # warm-up, then the measured step
    calls: list[str] = []

    def packed_step() -> float:
        return seconds[calls[-1]].pop(0)

    monkeypatch.setattr(throughput, "cpu_candidates", lambda: (["sdpa", "bucketed"], ""))
    name, why = choose_cpu_backend(m, packed_step)
    assert (name, calls[-1]) == ("bucketed", "bucketed")  # left set
    assert why == "the faster packed step, one each after a warm-up: sdpa 0.500 s, bucketed 0.300 s"
    monkeypatch.setattr(throughput, "cpu_candidates", lambda: (["sdpa"], "bucketed is not in X"))
    steps: list[Any] = []
    assert choose_cpu_backend(m, lambda: steps.append(1) or 1.0) == (
        "sdpa", "the only candidate: bucketed is not in X")  # fmt: skip
    assert steps == []  # nothing to measure
