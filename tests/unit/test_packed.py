"""PackedAttention: every backend available here against a dense-mask reference, forward and backward."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megapack.attention import BACKENDS, PackedAttention, backend_available
from megapack.core.batch import make_packed_seq_params

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS, GROUPS, DIM = 4, 2, 8


def config(**overrides: Any) -> SimpleNamespace:
    base = {"num_attention_heads": HEADS, "num_query_groups": GROUPS, "kv_channels": DIM, "attention_dropout": 0.0,
            "context_parallel_size": 1, "window_size": None, "softmax_type": "vanilla"}  # fmt: skip
    return SimpleNamespace(**{**base, **overrides})


TP1 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))


def attention(backend: str, **overrides: Any) -> PackedAttention:
    return PackedAttention(config(**overrides), 1, None, "self", pg_collection=TP1, backend=backend)


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: list[int], buffer: list[int]
) -> torch.Tensor:
    """Softmax over an explicit [T, T] mask: same document and key position <= query position."""
    total = q.shape[0]
    doc = torch.full((total,), -1)
    for i in range(len(real) - 1):
        doc[buffer[i] : buffer[i] + real[i + 1] - real[i]] = i
    pos = torch.arange(total)
    allowed = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0) & (pos[:, None] >= pos[None, :])
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1))  # padding rows: all masked -> 0
    return torch.einsum("hqk,khd->qhd", probs, vv).reshape(total, -1)


def inputs(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k = torch.randn(total, GROUPS, DIM, generator=g)
    v = torch.randn(total, GROUPS, DIM, generator=g)
    return tuple(x.to(DEVICE).requires_grad_() for x in (q, k, v))


CASES = {
    "unpadded": ([0, 3, 5, 9, 16], None),
    "one-doc": ([0, 11], None),
    "aligned-padding": ([0, 3, 5, 9], [0, 4, 8, 12]),
}


HALF_ONLY = ("flash_attn", "te", "torch_varlen", "cudnn")  # float16/bfloat16 only


def dtype_of(name: str) -> torch.dtype:
    return torch.bfloat16 if name in HALF_ONLY else torch.float32


def tolerance(name: str) -> dict[str, Any]:
    return {"rtol": 2e-2, "atol": 2e-2} if name in HALF_ONLY else {"rtol": 1e-5, "atol": 1e-5}


def backend_param(name: str, training: bool) -> Any:
    ok = backend_available(name, DEVICE, training=training, dtype=dtype_of(name))
    reason = f"{name} cannot run {'backward' if training else 'forward'} on {DEVICE.type} here"
    return pytest.param(name, id=name, marks=pytest.mark.skipif(not ok, reason=reason))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", [backend_param(b, training=True) for b in BACKENDS])
def test_forward_and_backward_match_reference(backend: str, case: str) -> None:
    real, padded = CASES[case]
    buffer = padded or real
    q, k, v = (x.detach().to(dtype_of(backend)).requires_grad_() for x in inputs(buffer[-1], seed=len(case)))  # fmt: skip
    params = make_packed_seq_params(
        torch.tensor(real, dtype=torch.int32, device=DEVICE),
        None if padded is None else torch.tensor(padded, dtype=torch.int32, device=DEVICE),
        max(b - a for a, b in itertools.pairwise(buffer)),
    )
    out = attention(backend)(q, k, v, None, packed_seq_params=params)
    grads_out = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    q_ref, k_ref, v_ref = (x.detach().float().cpu().requires_grad_() for x in (q, k, v))
    ref = dense_reference(q_ref, k_ref, v_ref, real, buffer)
    assert out.shape == (buffer[-1], HEADS * DIM)
    torch.testing.assert_close(out.float().cpu(), ref, **tolerance(backend))
    grads_ref = torch.autograd.grad(ref.square().sum(), (q_ref, k_ref, v_ref))
    for got, want in zip(grads_out, grads_ref, strict=True):
        torch.testing.assert_close(got.float().cpu(), want, **tolerance(backend))


@pytest.mark.parametrize("backend", [backend_param(b, training=False) for b in BACKENDS])
def test_forward_only_matches_reference(backend: str) -> None:
    real = [0, 3, 5, 9, 16]
    q, k, v = (x.detach().to(dtype_of(backend)) for x in inputs(16, seed=7))
    params = make_packed_seq_params(torch.tensor(real, dtype=torch.int32, device=DEVICE), None, 7)
    with torch.no_grad():
        out = attention(backend)(q, k, v, None, packed_seq_params=params)
    want = dense_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), real, real)
    torch.testing.assert_close(out.float().cpu(), want, **tolerance(backend))


def test_first_token_of_each_document_sees_only_itself() -> None:
    # Worked example: documents [3, 2, 4] -> cu_seqlens [0, 3, 5, 9]. A document's first token has
    # one key (itself), so its output is its own value vector, whatever came before it.
    q, k, v = (x.detach() for x in inputs(9, seed=1))
    params = make_packed_seq_params(
        torch.tensor([0, 3, 5, 9], dtype=torch.int32, device=DEVICE), None, 4
    )
    out = attention("sdpa")(q, k, v, None, packed_seq_params=params).reshape(9, HEADS, DIM)
    for start in (0, 3, 5):
        want = v[start].repeat_interleave(HEADS // GROUPS, dim=0)
        torch.testing.assert_close(out[start], want)


def test_padded_batches_use_causal_attention_or_megatron_mask() -> None:
    s, b = 6, 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(s, b, HEADS, DIM, generator=g),
        torch.randn(s, b, GROUPS, DIM, generator=g),
        torch.randn(s, b, GROUPS, DIM, generator=g),
    )
    module = attention("sdpa")
    causal = module(q, k, v, None)
    for row in range(b):
        ref = dense_reference(q[:, row], k[:, row], v[:, row], [0, s], [0, s])
        torch.testing.assert_close(causal[:, row], ref, rtol=1e-5, atol=1e-5)
    mask = ~torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(b, 1, s, s)  # True = masked out
    torch.testing.assert_close(module(q, k, v, mask), causal, rtol=1e-6, atol=1e-6)


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        attention("fast")
    with pytest.raises(ValueError, match=r"cp_layout must be one of .* got 'zigzag'"):
        PackedAttention(config(), 1, None, "self", pg_collection=TP1, cp_layout="zigzag")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="num_attention_heads=4 and num_query_groups=3 must divide by tp=2"
    ):
        PackedAttention(config(num_query_groups=3), 1, None, "self",
                        pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 2)))  # fmt: skip
    q, k, v = inputs(4, seed=0)
    params = make_packed_seq_params(torch.tensor([0, 4], dtype=torch.int32, device=DEVICE), None, 4)
    with pytest.raises(ValueError, match="attention_bias"):
        attention("sdpa")(q, k, v, None, attention_bias=torch.zeros(1), packed_seq_params=params)
    if DEVICE.type == "cpu":
        with pytest.raises(
            ValueError,
            match=r"'flex' cannot run training on cpu float32: flex_attention has no backward on "
            r"CPU .* use backend='auto' \(here: 'bucketed'\)",
        ):
            attention("flex")(q, k, v, None, packed_seq_params=params)
        with pytest.raises(ValueError, match="'flash_attn' cannot run training on cpu float32"):
            attention("flash_attn")(q, k, v, None, packed_seq_params=params)


# ---- flex: one block mask per micro-batch, one compiled graph ---------------------------------

MASK_CASES = {  # (cu_real, cu_buffer or None, total, block)
    "unpadded-128": ([0, 100, 101, 400, 433], None, 433, 128),
    "padded-16": ([0, 3, 4, 40, 47], [0, 16, 32, 80, 96], 96, 16),
    "one-token-docs-16": ([0, 1, 2, 3, 36], [0, 8, 16, 24, 64], 64, 16),
    "tail-16": ([0, 5, 25], [0, 16, 37], 37, 16),  # T cuts the last tile: partial tiles only
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_flex_block_tables_equal_create_block_mask(case: str) -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    from megapack.attention.flex import document_intervals, interval_block_mask

    real, buffer, total, block = MASK_CASES[case]
    cu_real = torch.tensor(real)
    cu_buffer = cu_real if buffer is None else torch.tensor(buffer)
    lo, hi, extra = document_intervals(torch.arange(total), cu_buffer, cu_real)
    ours = interval_block_mask(lo, hi, extra, total, block=block)
    doc = torch.searchsorted(cu_buffer[1:], torch.arange(total), right=True)
    length = (cu_real[1:] - cu_real[:-1])[doc.clamp(max=len(real) - 2)]
    is_real = torch.arange(total) - cu_buffer[doc.clamp(max=len(real) - 2)] < length

    def brute(b: Any, h: Any, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return (doc[qi] == doc[ki]) & (ki <= qi) & (is_real[ki] | (qi == ki))

    want = create_block_mask(brute, None, None, total, total, device="cpu", BLOCK_SIZE=block)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(ours, name), getattr(want, name)), name
    assert ours.kv_num_blocks.sum() > 0 and (ours.full_kv_num_blocks.sum() > 0) != (
        case == "tail-16"
    )
    pairs = torch.cartesian_prod(torch.arange(total), torch.arange(total))
    mask_mod = ours.mask_mod
    got = mask_mod(0, 0, pairs[:, 0], pairs[:, 1])
    assert torch.equal(got, brute(0, 0, pairs[:, 0], pairs[:, 1]))


def test_flex_mask_is_built_once_per_micro_batch() -> None:
    from megapack.attention.documents import Documents
    from megapack.attention.flex import document_block_mask

    params = make_packed_seq_params(torch.tensor([0, 5, 16], dtype=torch.int32), None, 11)
    docs = Documents.from_params(params, total=16)
    mask = document_block_mask(docs, torch.device("cpu"))
    # every later layer, and the backward's recompute, get the same Documents and mask
    assert Documents.from_params(params, total=16) is docs
    assert document_block_mask(Documents.from_params(params, total=16), torch.device("cpu")) is mask
    other = make_packed_seq_params(torch.tensor([0, 5, 16], dtype=torch.int32), None, 11)
    assert Documents.from_params(other, total=16) is not docs  # the next micro-batch: its own
    params.cu_seqlens_q.add_(0)  # modified in place: rebuilt
    assert Documents.from_params(params, total=16) is not docs


def test_flex_compiles_once_for_every_boundary_set_of_one_row_length() -> None:
    """Forward only: torch 2.13 has no flex backward on CPU (see the gpu test below)."""
    from torch._dynamo.utils import counters

    module = attention("flex")
    boundary_sets = [[0, 16], [0, 3, 5, 9, 16], [0, 1, 2, 15, 16], [0, 8, 16]]
    outputs, graphs = [], []
    for real in boundary_sets:
        q, k, v = (x.detach() for x in inputs(16, seed=len(real)))
        params = make_packed_seq_params(torch.tensor(real, dtype=torch.int32), None, 16)
        with torch.no_grad():
            for _layer in range(2):
                out = module(q, k, v, None, packed_seq_params=params)
        graphs.append(counters["stats"]["unique_graphs"])
        want = dense_reference(q, k, v, real, real)
        outputs.append(torch.allclose(out, want, rtol=1e-5, atol=1e-5))
    assert all(outputs)
    assert graphs[1:] == [graphs[0]] * 3, f"recompiled as boundaries changed: {graphs}"
    q, k, v = (x.detach() for x in inputs(24, seed=0))  # a new row length: one more graph (CPU)
    params = make_packed_seq_params(torch.tensor([0, 10, 24], dtype=torch.int32), None, 14)
    with torch.no_grad():
        module(q, k, v, None, packed_seq_params=params)
    assert counters["stats"]["unique_graphs"] == graphs[0] + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex backward needs CUDA in torch")
def test_flex_training_on_cuda_matches_reference_without_recompiles() -> None:
    from torch._dynamo.utils import counters

    module = attention("flex")
    graphs = []
    for real in ([0, 300, 700, 1024], [0, 1, 512, 1024], [0, 1024]):
        q, k, v = (x.to(torch.bfloat16).detach().requires_grad_() for x in inputs(1024, seed=1))
        params = make_packed_seq_params(torch.tensor(real, dtype=torch.int32, device=DEVICE), None, 1024)  # fmt: skip
        out = module(q, k, v, None, packed_seq_params=params)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        ref_in = [x.detach().float().cpu().requires_grad_() for x in (q, k, v)]
        ref = dense_reference(ref_in[0], ref_in[1], ref_in[2], real, real)
        want = torch.autograd.grad(ref.square().sum(), ref_in)
        torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
        for got, expected in zip(grads, want, strict=True):
            torch.testing.assert_close(got.float().cpu(), expected, rtol=5e-2, atol=5e-2)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[0]] * 2, f"recompiled as boundaries changed: {graphs}"


def test_attention_package_imports_only_what_its_docstring_allows() -> None:
    """megapack.attention may import torch, numpy and the megapack.core modules its docstring names, never delivery."""
    from pathlib import Path

    import megapack.attention
    from tests.unit.test_layering import imported_modules

    allowed = (
        "megapack.attention",
        "megapack.core.cp_share",
        "megapack.core.quiet",
        "megapack.core.capture",
        "megapack.core.buckets",
        "megapack.core.seq_params",
        "megapack.core.errors",
    )
    package = Path(megapack.attention.__file__).parent
    offenders = {}
    for path in sorted(package.glob("*.py")):
        names = imported_modules(path.read_text(), "megapack.attention")
        bad = sorted(
            n for n in names
            if n.split(".")[0] == "megapack" and n != "megapack"
            and not any(n == a or n.startswith(a + ".") for a in allowed)
        )  # fmt: skip
        if bad:
            offenders[path.name] = bad
    assert offenders == {}


def test_auto_backend_is_resolved_once_per_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    import megapack.attention.packed as packed

    calls = []
    real = packed.resolve_backend
    monkeypatch.setattr(packed, "resolve_backend", lambda *a, **k: calls.append(a) or real(*a, **k))
    cu = torch.tensor([0, 3, 5, 9, 16], dtype=torch.int32, device=DEVICE)
    params = make_packed_seq_params(cu, None, 7)
    layers = [attention("auto") for _ in range(4)]
    q, k, v = inputs(16, seed=3)
    outs = [layer(q, k, v, None, packed_seq_params=params) for layer in layers]  # 4 layers, 1 batch
    assert len(calls) == 1 and all(torch.equal(o, outs[0]) for o in outs)
    with torch.no_grad():  # another choice (no gradient): resolved again, once
        layers[0](q, k, v, None, packed_seq_params=params)
        layers[1](q, k, v, None, packed_seq_params=params)
    assert len(calls) == 2
    layers[0](q, k, v, None, packed_seq_params=make_packed_seq_params(cu.clone(), None, 7))
    assert len(calls) == 3  # the next micro-batch's boundaries: its first layer chooses again
