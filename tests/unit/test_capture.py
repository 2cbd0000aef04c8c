"""CUDA-graph capture and batch-derived caches: nothing a warm-up derived is reused inside a
capture, nothing a capture derived is reused after it (megapack.core.capture, Documents).

Capture needs CUDA; these tests fake it by patching ``torch.cuda.is_current_stream_capturing``
(and, where two captures must differ, the runtime's capture id), then check every cache keyed on
a batch: the `Documents` of ``packed_seq_params`` and of a boundary tensor, everything in its memo
(segment ids, offsets, the flex block mask, RoPE's cos/sin, the backend choice, the CP plan), and
that kernels which read the host refuse to run inside a capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

import megapack
from megapack.attention import PackedAttention, packed_attention
from megapack.attention.cp_plan import CpPlan, plan_for
from megapack.attention.documents import Documents
from megapack.attention.rope import apply_rope
from megapack.core import capture
from megapack.core.errors import CaptureError
from megapack.core.seq_params import make_packed_seq_params

CPU = megapack.Topology.single(torch.device("cpu"))


@contextlib.contextmanager
def faked_capture(monkeypatch: pytest.MonkeyPatch, ident: int | None = None) -> Iterator[None]:
    """Inside: the current stream reports a capture (with runtime id ``ident``, None: no runtime)."""
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        m.setattr(capture, "_runtime_capture_id", lambda: ident)
        yield


def params_for(cu: list[int], longest: int) -> object:
    return make_packed_seq_params(torch.tensor(cu, dtype=torch.int32), None, longest)


def test_tokens_outside_inside_and_between_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    assert capture.capture_token() is None and not capture.capturing()
    with faked_capture(monkeypatch, ident=7):
        assert capture.capture_token() == ("capture", 7)
    with faked_capture(monkeypatch):  # no runtime id: an epoch per capture
        first = capture.capture_token()
        assert capture.capture_token() == first  # the same capture, layer after layer
    assert capture.capture_token() is None  # an eager lookup between captures ...
    with faked_capture(monkeypatch):
        assert capture.capture_token() != first  # ... starts a new epoch
        second = capture.capture_token()
    seen = [first, second]
    for _ in range(3):  # captures in a row with no eager call between them: each says so
        capture.new_capture_epoch()
        with faked_capture(monkeypatch):
            token = capture.capture_token()
            assert token not in seen and capture.capture_token() == token
        seen.append(token)


def test_a_warm_up_documents_is_rebuilt_inside_a_capture_and_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params = params_for([0, 3, 8, 16], 8)
    warm = Documents.from_params(params, total=16)
    warm_ids, warm_offsets = warm.segment_ids(), warm.offsets()
    assert Documents.from_params(params, total=16) is warm  # eager layers share it
    with faked_capture(monkeypatch, ident=1):
        inside = Documents.from_params(params, total=16)
        assert inside is not warm and inside.token == ("capture", 1)
        assert inside.segment_ids() is not warm_ids and inside.offsets() is not warm_offsets
        assert torch.equal(inside.offsets(), warm_offsets)  # rebuilt, the same values
        assert Documents.from_params(params, total=16) is inside  # the capture's other layers
    with faked_capture(monkeypatch, ident=2):  # another capture: its own
        assert Documents.from_params(params, total=16) is not inside
    after = Documents.from_params(params, total=16)
    assert after is not inside and after is not warm and after.token is None


def test_documents_cached_on_a_boundary_tensor_follow_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    warm = Documents.cached(cu, None, 5, 9)
    assert Documents.cached(cu, None, 5, 9) is warm
    with faked_capture(monkeypatch, ident=3):
        inside = Documents.cached(cu, None, 5, 9)
        assert inside is not warm and Documents.cached(cu, None, 5, 9) is inside
    assert Documents.cached(cu, None, 5, 9) is not inside


def test_every_memo_entry_is_rebuilt_inside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """flex's block mask, RoPE's cos/sin and the backend choice live in the micro-batch's memo."""
    from megapack.attention.flex import document_block_mask

    params = params_for([0, 3, 8, 16], 8)
    table = torch.randn(16, 1, 1, 4)
    t = torch.randn(16, 2, 4)

    def derived() -> tuple[object, object, object]:
        docs = Documents.from_params(params, total=16)
        mask = document_block_mask(docs, torch.device("cpu"))
        apply_rope(t, table, docs.offsets(), interleaved=False, docs=docs)
        rope = next(v for k, v in docs.memo.items() if isinstance(k, tuple) and k[0] == "rope")
        return mask, rope[2], docs.memo

    warm_mask, warm_cos, warm_memo = derived()
    assert derived()[0] is warm_mask and derived()[1] is warm_cos  # reused eagerly
    with faked_capture(monkeypatch, ident=4):
        mask, cos, memo = derived()
        assert mask is not warm_mask and cos is not warm_cos and memo is not warm_memo
        assert derived()[0] is mask  # the capture's layers share what it built
    after_mask, after_cos, _ = derived()
    assert after_mask is not mask and after_cos is not cos


def test_the_backend_choice_is_made_again_inside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    import megapack.attention.packed as packed

    calls: list[str] = []
    real = packed.resolve_backend

    def counting(*args: object, **kwargs: object) -> str:
        calls.append("resolve")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(packed, "resolve_backend", counting)
    config = SimpleNamespace(num_attention_heads=2, num_query_groups=2, kv_channels=4,
                             attention_dropout=0.0)  # fmt: skip
    layer = PackedAttention(config, 1, None, "self", pg_collection=SimpleNamespace(tp=_One()))
    params = params_for([0, 3, 8], 5)
    q = torch.randn(8, 2, 4)
    layer(q, q, q, None, packed_seq_params=params)
    layer(q, q, q, None, packed_seq_params=params)
    assert calls == ["resolve"]
    with faked_capture(monkeypatch, ident=5), pytest.raises(CaptureError, match="'bucketed'"):
        layer(q, q, q, None, packed_seq_params=params)  # resolved again, then bucketed refuses
    assert calls == ["resolve", "resolve"]


class _One:
    def size(self) -> int:
        return 1


def test_kernels_that_read_the_host_refuse_inside_a_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q = torch.randn(8, 2, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed_attention(q, q, q, cu_seqlens=cu, max_seqlen=5, backend="sdpa")  # eager: fine
    with faked_capture(monkeypatch, ident=6):
        with pytest.raises(CaptureError, match="cannot be recorded; capture with backend 'cudnn'"):
            packed_attention(q, q, q, cu_seqlens=cu, max_seqlen=5, backend="sdpa")
        with pytest.raises(CaptureError, match="context-parallel attention's plan"):
            CpPlan.build(cu, cu, cp_size=2, cp_rank=0, layout="row", local_total=4)
        docs = Documents.from_params(params_for([0, 3, 8], 5), total=4)
        with pytest.raises(CaptureError, match="context_parallel_size=1"):
            plan_for(docs, cp_size=2, cp_rank=0, layout="row", local_total=4)


def test_graph_inputs_refilled_a_b_a_give_each_pack_its_own_result() -> None:
    """Identity-keyed caches see GraphInputs' in-place refills (its tensors' versions move)."""
    from megapack.data import Document, PackedDataset

    docs = [Document(tokens=torch.arange(1, n + 1).numpy(), loss_mask=torch.ones(n).numpy())
            for n in (3, 9, 5, 12, 7, 2, 11, 4)]  # fmt: skip
    ds = PackedDataset(docs, seq_len=16, max_documents=4)
    shape = megapack.StaticShape(max_segments=5, max_seqlen=16)
    batches = [megapack.get_batch_on_this_tp_rank(iter([ds[i]]), topology=CPU, static=shape)
               for i in range(2)]  # fmt: skip
    a, b = batches
    assert not torch.equal(a["cu_seqlens"], b["cu_seqlens"])
    inputs = megapack.GraphInputs(a)
    config = SimpleNamespace(num_attention_heads=2, num_query_groups=2, kv_channels=4,
                             attention_dropout=0.0)  # fmt: skip
    layer = PackedAttention(config, 1, None, "self", backend="sdpa",
                            pg_collection=SimpleNamespace(tp=_One()))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 2, 4, generator=g)

    def run(batch: dict) -> torch.Tensor:
        return layer(q, q, q, None, packed_seq_params=batch["packed_seq_params"])

    expected = [run(a), run(b), run(a)]
    assert not torch.equal(expected[0], expected[1])
    got = [run(inputs.load(x)) for x in (a, b, a)]
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


def test_the_runtime_capture_id_and_its_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=77))
    monkeypatch.setattr(capture, "_capture_query", lambda: lambda s: asked.append(s) or 42)
    assert capture._runtime_capture_id() == 42 and asked == [77]  # the current stream's id

    def broken(stream: int) -> int:
        raise RuntimeError("driver too old")

    said: list[str] = []
    monkeypatch.setattr(capture, "_capture_query", lambda: broken)
    monkeypatch.setattr(capture, "_warn_once", said.append)
    assert capture._runtime_capture_id() is None  # epochs instead, and it says why
    assert said == [
        "cudaStreamGetCaptureInfo failed (driver too old); capture ids fall back to epochs"
    ]
    monkeypatch.setattr(capture, "_capture_query", lambda: None)
    assert capture._runtime_capture_id() is None


def test_libcudart_is_found_by_torchs_cuda_major_then_its_plain_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tried: list[str] = []

    def cdll(name: str) -> str:
        tried.append(name)
        if name != "libcudart.so":
            raise OSError(f"{name}: cannot open shared object file")
        return "the library"

    monkeypatch.setattr(capture.ctypes, "CDLL", cdll)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert capture._libcudart() == "the library" and tried == ["libcudart.so.13", "libcudart.so"]
    monkeypatch.setattr(capture.ctypes, "CDLL", lambda name: tried.append(name) or name)
    assert capture._libcudart() == "libcudart.so.13"  # the versioned name first
    monkeypatch.setattr(capture.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    assert capture._libcudart() is None
