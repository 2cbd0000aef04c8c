"""Items the callers' datasets yield, and the single-rank reference of what a micro-batch holds.

    megatron_item   Megatron's SFTDataset / inter-document masking / GPTDataset rows [b, S]:
                    ``cu_seqlens`` [b, k] ending at S, then ``-1`` (NeMo's packed data) or S
                    sentinels, optional ``cu_seqlens_padded`` (real lengths back to back),
                    ``max_seqlen`` [b] int32; or plain rows, optionally with an attention mask
    bridge_item     Bridge's offline-packed rows: ``cu_seqlens_q``/``_kv`` (and ``*_padded``)
                    [b, k] padded by repeats, ``max_seqlen_q``/``_kv`` [b, 1], ``padding_mask``,
                    ``token_count``; or its older keys (``cu_seqlens`` with -1, ``max_seqlen``)
    reference       what one rank holding every field sees: rows merged into THD [1, b*S],
                    boundaries without sentinels, the longest buffer segment

`reference` is written from the layout alone (plain lists), not from megapack's merge.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

S = 16
"""A row's tokens (Megatron's --seq-length in these tests)."""


def _lengths(gen: torch.Generator, total: int, step: int = 1) -> list[int]:
    """Random document lengths, multiples of ``step``, summing to ``total``."""
    out: list[int] = []
    while sum(out) < total:
        n = step * int(torch.randint(1, max(2, total // (3 * step)) + 1, (1,), generator=gen))
        out.append(min(n, total - sum(out)))
    return out


def megatron_item(
    seed: int,
    mbs: int,
    *,
    kind: str = "sft",
    sentinel: int = -1,
    mask: bool = False,
    step: int | None = None,
) -> dict[str, Any]:
    """Megatron rows: ``kind`` "sft" (cu_seqlens), "padded" (and cu_seqlens_padded), "plain";
    ``step``: the documents' (buffer) lengths a multiple of it (default 2 padded, else 1)."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(1, 1000, (mbs, S + 1), generator=gen)
    item: dict[str, Any] = {"tokens": text[:, :-1], "labels": text[:, 1:],
                            "loss_mask": (torch.rand(mbs, S, generator=gen) > 0.2).float()}  # fmt: skip
    if kind == "plain":
        item["position_ids"] = torch.arange(S).repeat(mbs, 1)
        if mask:
            item["attention_mask"] = torch.tril(torch.ones(mbs, 1, S, S)).bool()
        return item
    real_rows, buffer_rows, positions = [], [], []
    for _ in range(mbs):
        buffer = _lengths(gen, S, step=step or (2 if kind == "padded" else 1))
        real = [n - int(torch.randint(0, 2, (1,), generator=gen)) if kind == "padded" and n > 1
                else n for n in buffer]  # fmt: skip
        real_rows.append(real)
        buffer_rows.append(buffer)
        positions.append(torch.cat([torch.arange(n) for n in buffer]))
    item["position_ids"] = torch.stack(positions)
    width = S + 1

    def table(rows: list[list[int]], pad: int) -> torch.Tensor:
        cum = [[0, *torch.tensor(r).cumsum(0).tolist()] for r in rows]
        return torch.tensor([c + [pad] * (width - len(c)) for c in cum], dtype=torch.int32)

    # a real row beside padded ones ends where its documents do, below S as a rule: -1 sentinels
    item["cu_seqlens"] = table(real_rows, -1 if kind == "padded" else sentinel)
    if kind == "padded":
        item["cu_seqlens_padded"] = table(buffer_rows, sentinel)
    longest = [max(b) for b in buffer_rows]
    item["max_seqlen"] = torch.tensor(longest, dtype=torch.int32)
    return item


def bridge_item(
    seed: int, mbs: int, *, padded: bool = True, legacy: bool = False, step: int | None = None
) -> dict[str, Any]:
    """Bridge's packed rows (see the module docstring); ``legacy``: its older keys."""
    item = megatron_item(seed, mbs, kind="padded" if padded else "sft", sentinel=S, step=step)
    cu = item.pop("cu_seqlens")
    buffer = item.pop("cu_seqlens_padded", None)
    max_seqlen = item.pop("max_seqlen").view(mbs, 1)
    if legacy:  # cu_seqlens are the buffer's, -1 sentinels; the real ones are cu_seqlens_unpadded
        item["cu_seqlens"] = _minus_one(buffer if buffer is not None else cu)
        if buffer is not None:
            item["cu_seqlens_unpadded"] = _minus_one(cu)
        item["max_seqlen"] = max_seqlen
        item["cu_seqlens_argmin"] = torch.tensor([[int((r < 0).nonzero()[0]) if (r < 0).any()
                                                   else len(r)] for r in item["cu_seqlens"]])  # fmt: skip
        return item
    item["cu_seqlens_q"] = _repeat_last(cu)
    item["cu_seqlens_kv"] = item["cu_seqlens_q"]
    if buffer is not None:
        item["cu_seqlens_q_padded"] = _repeat_last(buffer)
        item["cu_seqlens_kv_padded"] = item["cu_seqlens_q_padded"]
    item["max_seqlen_q"] = item["max_seqlen_kv"] = max_seqlen
    item["attention_mask"] = None
    item["loss_mask"] = item["loss_mask"].long()  # Bridge's packed loss_mask is a LongTensor
    item["padding_mask"] = torch.zeros(mbs, S, dtype=torch.bool)
    if buffer is not None:  # the buffer slots past each document's real tokens
        for row in range(mbs):
            real, buf = _row(item["cu_seqlens_q"][row]), _row(item["cu_seqlens_q_padded"][row])
            for i in range(len(buf) - 1):
                item["padding_mask"][row, buf[i] + real[i + 1] - real[i] : buf[i + 1]] = True
    item["token_count"] = [int(S - item["padding_mask"][r].sum()) for r in range(mbs)]
    return item


def _row(values: torch.Tensor) -> list[int]:
    """A boundary row without its sentinels (-1, or repeats of the last boundary)."""
    out: list[int] = []
    for v in values.tolist():
        if v < 0 or (out and v == out[-1]):
            break
        out.append(v)
    return out


def _repeat_last(table: torch.Tensor) -> torch.Tensor:
    rows = [_row(r) for r in table]
    width = table.shape[1]
    return torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.int32)


def _minus_one(table: torch.Tensor) -> torch.Tensor:
    rows = [_row(r) for r in table]
    width = table.shape[1]
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)


def reference(item: dict[str, Any]) -> dict[str, Any]:
    """One rank's view of ``item`` (Megatron's or Bridge's keys): THD values, plain lists."""
    if "cu_seqlens_q" in item:
        real_key, buffer_key = "cu_seqlens_q", "cu_seqlens_q_padded"
    elif "cu_seqlens_unpadded" in item:
        real_key, buffer_key = "cu_seqlens_unpadded", "cu_seqlens"
    else:
        real_key, buffer_key = "cu_seqlens", "cu_seqlens_padded"
    tokens = item["tokens"]
    b, s = tokens.shape
    out: dict[str, Any] = {}
    if item.get(real_key) is None:  # plain rows stay [b, s]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            out[key] = item[key].tolist()
        out["cu_seqlens"] = out["cu_seqlens_padded"] = out["max_seqlen"] = None
        mask = item.get("attention_mask")
        out["attention_mask"] = None if mask is None else mask.tolist()
        return out
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        out[key] = [item[key].reshape(-1).float().tolist() if key == "loss_mask"
                    else item[key].reshape(-1).tolist()]  # fmt: skip
    real_rows = [_row(r) for r in item[real_key].reshape(b, -1)]
    if item.get(buffer_key) is not None:
        buffer_rows = [_row(r) for r in item[buffer_key].reshape(b, -1)]
        merged_buffer = [0]
        for row, buf in enumerate(buffer_rows):
            merged_buffer += [row * s + v for v in buf[1:]]
        merged = [0]
        for real in real_rows:  # real lengths back to back
            for u, v in itertools.pairwise(real):
                merged.append(merged[-1] + v - u)
        out["cu_seqlens"], out["cu_seqlens_padded"] = merged, merged_buffer
        segments = merged_buffer
    else:
        merged = [0]
        for row, real in enumerate(real_rows):
            merged += [row * s + v for v in real[1:]]
        out["cu_seqlens"], out["cu_seqlens_padded"] = merged, None
        segments = merged
    out["max_seqlen"] = max(v - u for u, v in itertools.pairwise(segments))
    out["attention_mask"] = None
    if "padding_mask" in item:
        out["padding_mask"] = [item["padding_mask"].reshape(-1).tolist()]
    return out


def zigzag(values: list[Any], spans: list[int], cp: int, rank: int) -> list[Any]:
    """CP rank ``rank``'s share of a row's ``values``: each span between two ``spans`` boundaries
    in ``2 * cp`` chunks, chunks ``rank`` and ``2 * cp - 1 - rank`` kept (Megatron's zigzag)."""
    out: list[Any] = []
    for a, b in itertools.pairwise(spans):
        chunk = (b - a) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out += values[a + c * chunk : a + (c + 1) * chunk]
    return out
