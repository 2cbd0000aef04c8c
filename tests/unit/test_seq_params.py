"""megapack.core.seq_params: megatron-core's PackedSeqParams looked up once per process (importing
megatron is slow and its warnings are quieted only that first time), every field filled."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator

import pytest
import torch

from megapack.core import quiet
from megapack.core.seq_params import make_packed_seq_params

MODULE = "megatron.core.packed_seq_params"
CU = torch.tensor([0, 3, 5, 9], dtype=torch.int32)


@pytest.fixture
def quieted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times `quiet_megatron` was entered (the import path), counted."""
    entered: list[int] = []
    real = quiet.quiet_megatron

    @contextlib.contextmanager
    def counting() -> Iterator[None]:
        entered.append(1)
        with real():
            yield

    monkeypatch.setattr(quiet, "quiet_megatron", counting)
    return entered


def test_once_megatron_is_imported_a_call_neither_imports_nor_quiets_again(
    quieted: list[int],
) -> None:
    import megatron.core.packed_seq_params as module

    for _ in range(3):
        params = make_packed_seq_params(CU, None, 4)
        assert type(params) is module.PackedSeqParams and params.max_seqlen_q == 4
    assert quieted == []


def test_the_first_call_imports_megatron_quietly(
    quieted: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import megatron.core

    monkeypatch.setattr(megatron.core, "packed_seq_params", sys.modules[MODULE])  # restored after
    monkeypatch.delitem(sys.modules, MODULE)  # as in a process that has not imported it yet
    params = make_packed_seq_params(CU, CU, 4, local_cp_size=2)
    assert quieted == [1]
    fresh = sys.modules[MODULE]  # imported by the call
    assert type(params) is fresh.PackedSeqParams and dataclasses.is_dataclass(params)
    assert params.qkv_format == "thd" and params.local_cp_size == 2
    assert params.cu_seqlens_q is CU and params.cu_seqlens_kv_padded is CU
