"""The cudnn backend's host side (megapack.attention.cudnn): shape classes, the per-micro-batch
offsets, the graphs megapack describes to cuDNN (checked against the installed frontend's own
signatures, on CPU), the reasons it cannot run, and ``auto``'s fallback when a graph cannot be
built. The graphs executed by a CPU stand-in for cuDNN's runtime: test_cudnn_standin.py; on an
sm90 GPU: the kit (scripts/gpu_check.sh)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from megapack.attention import choice
from megapack.attention.choice import Installed, choose, preference, refusal
from megapack.attention.cudnn import (
    CudnnUnavailable,
    GraphShape,
    batch_class,
    offsets_of,
    seqlen_class,
    shape_of,
    unavailable,
)
from megapack.attention.cudnn_graph import FORWARD, UIDS, describe, frontend, max_tokens_class
from megapack.attention.documents import Documents
from megapack.attention.kernels import KERNELS, attend
from megapack.attention.varlen import VarlenForm
from megapack.core.static import StaticShape, pad_static

BF16 = torch.bfloat16
V211 = VarlenForm(causal="window_size", scale=True, enable_gqa=False)


def hopper(**changes: object) -> Installed:
    fields = {"cuda": True, "flash_attn": False, "te": False, "varlen": V211, "flex": True,
              "cudnn_frontend": True, "cudnn_version": 91900, "sm": 90}  # fmt: skip
    return Installed(**{**fields, **changes})  # type: ignore[arg-type]


def shape(**changes: object) -> GraphShape:
    base = {"batch": 4, "seqlen": 64, "heads": 4, "groups": 2, "dim": 64, "dim_v": 64,
            "max_tokens": 64, "dtype": BF16, "scale": 0.125, "device": torch.device("cuda", 0),
            "deterministic": False}  # fmt: skip
    return GraphShape(**{**base, **changes})  # type: ignore[arg-type]


def test_shape_classes() -> None:
    assert [batch_class(n) for n in (0, 1, 2, 3, 5, 17, 82)] == [1, 1, 2, 4, 8, 32, 128]
    got = [seqlen_class(n) for n in (1, 64, 65, 3000, 4096, 4097)]
    assert got == [64, 64, 80, 3072, 4096, 4608]


def test_a_static_shape_is_one_graph_class_whatever_the_documents() -> None:
    static = StaticShape(max_segments=18, max_seqlen=4096)
    classes = set()
    for cu in ([0, 100, 4096], [0, 1, 2, 3, 4096], [0, 4000, 4096, 8192]):
        values = pad_static({"cu_seqlens": torch.tensor(cu, dtype=torch.int32),
                             "cu_seqlens_padded": None, "max_seqlen": 4000}, static)  # fmt: skip
        n = values["cu_seqlens"].shape[0] - 1
        classes.add((batch_class(n), seqlen_class(values["max_seqlen"])))
    assert classes == {(32, 4096)}


def test_offsets_worked_example_padding_gqa_and_extra_documents() -> None:
    docs = Documents(torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8]), 4, 8)  # padded buffer
    off = offsets_of(docs, shape(batch=4, heads=4, groups=2, dim=8, dim_v=8))
    assert off.q.shape == (5, 1, 1, 1) and off.q.dtype == torch.int64
    assert off.q.flatten().tolist() == [0, 128, 256, 256, 256]  # buffer x 4 heads x 8
    assert off.kv.flatten().tolist() == [0, 64, 128, 128, 128]  # x 2 groups x 8
    assert off.o is off.q and off.v is off.kv
    for lengths in (off.lengths_q, off.lengths_kv):
        assert lengths.dtype == torch.int32 and lengths.shape == (4, 1, 1, 1)
        assert lengths.flatten().tolist() == [3, 2, 0, 0]
    assert off.lengths_kv.data_ptr() != off.lengths_q.data_ptr()  # seq_len_q / _kv: two tensors
    assert offsets_of(docs, shape(batch=4, heads=4, groups=2, dim=8, dim_v=8)) is off  # memo
    wide_v = offsets_of(docs, shape(batch=2, heads=4, groups=2, dim=8, dim_v=16))
    assert wide_v.v.flatten().tolist() == [0, 128, 256] and wide_v.o.flatten().tolist() == [
        0,
        256,
        512,
    ]


def test_unavailable_names_why_on_this_machine() -> None:
    assert unavailable(torch.device("cpu"), BF16) == "cudnn runs on CUDA only"
    with pytest.raises(CudnnUnavailable, match="cudnn runs on CUDA only"):
        KERNELS["cudnn"](*(torch.zeros(4, 2, 8) for _ in range(3)),
                         Documents(torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4), 0.3, 0.0)  # fmt: skip


@pytest.mark.parametrize(
    "changes,dtype,dropout,why",
    [
        ({}, BF16, 0.0, None),
        ({"cudnn_frontend": False}, BF16, 0.0, "nvidia-cudnn-frontend is not installed"),
        ({"sm": 80}, BF16, 0.0, "needs sm90 or newer, this GPU is sm80"),
        ({"cudnn_version": 90500}, BF16, 0.0, "cuDNN 90500 is older than 9.6"),
        (
            {},
            torch.float32,
            0.0,
            "cudnn is cuDNN's fused attention and takes float16/bfloat16 only",
        ),
        ({}, BF16, 0.1, "cudnn has no attention dropout"),
    ],
)
def test_refusal_reasons(
    changes: dict, dtype: torch.dtype, dropout: float, why: str | None
) -> None:
    got = refusal(
        "cudnn", "cuda", dtype, training=True, dropout=dropout, installed=hopper(**changes)
    )
    assert got == why if why is None else why in got


def test_auto_prefers_te_then_cudnn_then_bucketed_on_hopper_only() -> None:
    assert preference("cuda", BF16, hopper())[:4] == ("te", "cudnn", "bucketed", "flash_attn")
    assert preference("cuda", BF16, hopper(sm=80))[:3] == ("flash_attn", "te", "torch_varlen")
    args = {"training": True, "dropout": 0.0}
    assert choose("cuda", BF16, installed=hopper(te=True), **args)[0] == "te"
    assert choose("cuda", BF16, installed=hopper(), **args)[0] == "cudnn"
    name, why = choose("cuda", BF16, installed=hopper(cudnn_frontend=False), **args)
    assert name == "torch_varlen" and "bucketed: no bucket plan delivered" in why
    assert (
        choose("cuda", BF16, installed=hopper(cudnn_frontend=False), planned=True, **args)[0]
        == "bucketed"
    )
    assert choose("cuda", BF16, installed=hopper(sm=80), **args)[0] == "torch_varlen"
    assert choose("cuda", BF16, installed=hopper(), excluded=frozenset({"cudnn"}), planned=True, **args)[0] == "bucketed"  # fmt: skip


def test_auto_falls_back_once_when_a_graph_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cuDNN refusal found only at run time: auto takes the next backend, logs it once, and
    never tries cudnn again in this process; an explicit cudnn raises cuDNN's reason."""
    calls = []

    def refusing(*args: object) -> torch.Tensor:
        calls.append(1)
        raise CudnnUnavailable("cuDNN cannot build the forward graph for GraphShape(...): nope")

    monkeypatch.setitem(KERNELS, "cudnn", refusing)
    monkeypatch.setattr(choice, "_failed", {})
    monkeypatch.setattr(choice, "_installed", lambda: Installed(
        cuda=False, flash_attn=False, te=False, varlen=None, flex=False))  # fmt: skip
    q = torch.randn(8, 2, 4)
    docs = Documents(torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8]), 5, 8)
    with caplog.at_level(logging.WARNING, logger="megapack.attention"):
        for _ in range(2):
            ran, out = attend("cudnn", q, q, q, docs, 0.5, 0.0, auto=True, training=False)
            assert ran == "bucketed"
            torch.testing.assert_close(out, KERNELS["sdpa"](q, q, q, docs, 0.5, 0.0))
    warnings = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert warnings == ["attention backend cudnn cannot run here, falling back: cuDNN cannot build "
                        "the forward graph for GraphShape(...): nope"]  # fmt: skip
    assert choice._failed == {
        "cudnn": "cuDNN cannot build the forward graph for GraphShape(...): nope"
    }
    with pytest.raises(
        ValueError, match="attention backend 'cudnn' cannot run here: cuDNN cannot build"
    ):
        attend("cudnn", q, q, q, docs, 0.5, 0.0, auto=False, training=False)


needs_frontend = pytest.mark.skipif(
    frontend() is None, reason="nvidia-cudnn-frontend not installed"
)


def _backend_parameters(op: str) -> set[str]:
    """The keyword names the installed frontend's C++ builder takes for ``op``."""
    doc = getattr(frontend().module._pybind_module.backend_graph, op).__doc__
    header = doc.split("\n", 1)[0]
    return set(re.findall(r"(\w+): ", header)) - {"self"}


@needs_frontend
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_described_graphs_use_the_frontends_own_parameters(kind: str) -> None:
    """The graph as megapack asks for it: ragged [B, H, S, D] views of THD tensors, padding mask
    of real lengths, causal (top-left, right bound 0), every kwarg one the frontend defines."""
    module = frontend().module
    s = shape(batch=8, seqlen=128, heads=16, groups=4, dim=128, dim_v=128, max_tokens=1024)
    graph, uids = describe(module, kind, s, handle=None)
    (node,) = graph.nodes
    op = "sdpa" if kind == "forward" else "sdpa_backward"
    assert set(node.params) | set(node.inputs) <= _backend_parameters(op) | {"_dropout_n"}
    params = node.params
    assert params["use_padding_mask"] is True and params["diagonal_band_right_bound"] == 0
    assert params["diagonal_alignment"] == module.diagonal_alignment.TOP_LEFT
    assert params["attn_scale"] == 0.125
    q = node.inputs["q"]
    assert q.dim == [8, 16, 128, 128] and q.stride == [128 * 16 * 128, 128, 16 * 128, 1]
    assert q.ragged_offset.uid == UIDS["q_offsets"] and q.ragged_offset.dim == [9, 1, 1, 1]
    k = node.inputs["k"]
    assert k.dim == [8, 4, 128, 128] and k.stride == [128 * 4 * 128, 128, 4 * 128, 1]
    for name in ("seq_len_q", "seq_len_kv"):  # two tensors, as TE and the frontend's samples
        lengths = node.inputs[name]
        assert lengths.uid == UIDS[name.replace("seq_len", "lengths")]
        assert lengths.dim == [8, 1, 1, 1] and lengths.data_type == module.data_type.INT32
    # per-document lengths (every cuDNN >= 9.6), not cu_seq_len_q (cuDNN 9.24+ only)
    assert "cu_seq_len_q" not in node.inputs
    outputs = {t.uid: t for t in node.outputs.values()}
    if kind == "forward":  # max_total_seq_len sizes backward's accumulators: backward only
        assert "max_total_seq_len_q" not in params and "max_total_seq_len_kv" not in params
        assert params["generate_stats"] is True
        assert outputs[UIDS["o"]].ragged_offset.uid == UIDS["o_offsets"]
        assert outputs[UIDS["stats"]].dim == [8, 16, 128, 1]
    else:
        assert params["max_total_seq_len_q"] == params["max_total_seq_len_kv"] == 1024
        assert params["use_deterministic_algorithm"] is False
        assert {UIDS["dQ"], UIDS["dK"], UIDS["dV"]} <= set(outputs)
        assert outputs[UIDS["dK"]].dim == [8, 4, 128, 128]
        assert node.inputs["dO"].ragged_offset.uid == UIDS["o_offsets"]
    assert set(uids) == set(FORWARD) | ({"dO", "dQ", "dK", "dV"} if kind == "backward" else set())
    assert {t.uid for t in (*node.inputs.values(), *node.outputs.values())} <= set(uids.values())


@needs_frontend
def test_the_frontend_is_the_pinned_release() -> None:
    from megapack.attention.cudnn import FRONTEND_PIN

    assert frontend().module.__version__ == FRONTEND_PIN


def test_max_total_seq_len_is_t_rounded_up_to_64_as_the_frontends_tests_do() -> None:
    """issue 48: the exact T was passed; the frontend's ragged tests use max(64, ceil64(T))."""
    for total, want in ((1, 64), (40, 64), (64, 64), (65, 128), (100, 128), (14398, 14400)):
        assert max_tokens_class(total) == want
        assert want == max(64, ((total + 63) // 64) * 64)  # test/python/sdpa/fp16.py's rule
    docs = Documents(torch.tensor([0, 30, 40]), torch.tensor([0, 30, 40]), 30, 40)
    q, kv = torch.zeros(40, 16, 128), torch.zeros(40, 4, 128)
    assert shape_of(docs, q, kv, kv, 0.1).max_tokens == 64


@needs_frontend
def test_the_backward_graph_asks_for_the_rounded_token_count() -> None:
    graph, _ = describe(
        frontend().module, "backward", shape(max_tokens=max_tokens_class(100)), None
    )
    (node,) = graph.nodes
    assert node.params["max_total_seq_len_q"] == node.params["max_total_seq_len_kv"] == 128


def test_docstring_examples() -> None:
    import doctest

    from megapack.attention import cudnn, cudnn_graph

    for module in (cudnn, cudnn_graph):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ---- what mutation testing found unguarded (docs/records/mutation.md, 2026-11-28) -------------


@pytest.mark.parametrize(
    ("dtype", "head_dim", "why"),
    [
        (BF16, 128, None),
        (torch.float16, 8, None),
        (BF16, 256, None),
        (BF16, None, None),  # no head dim given: the environment only
        (BF16, 100, "cuDNN's fused attention needs a head dim that is a multiple of 8 and <= 256, got 100"),
        (BF16, 264, "cuDNN's fused attention needs a head dim that is a multiple of 8 and <= 256, got 264"),
        (BF16, 4, "cuDNN's fused attention needs a head dim that is a multiple of 8 and <= 256, got 4"),
        (torch.float32, 100, "cudnn is cuDNN's fused attention and takes float16/bfloat16 only"),
    ],
)  # fmt: skip
def test_unavailable_on_a_hopper_gpu_checks_the_dtype_then_the_head_dim(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int | None, why: str | None
) -> None:
    """The environment check as on an sm90 GPU with cuDNN 9.19 and the frontend installed."""
    monkeypatch.setattr(choice, "installed_here", lambda: hopper())
    got = unavailable(torch.device("cuda", 0), dtype, head_dim)
    assert got == why if why is None or "head dim" in why else why in str(got)
    assert unavailable(torch.device("cpu"), dtype, head_dim) == "cudnn runs on CUDA only"
    monkeypatch.setattr(choice, "installed_here", lambda: hopper(sm=80))
    assert "needs sm90 or newer, this GPU is sm80" in str(
        unavailable(torch.device("cuda", 0), BF16, 64)
    )


class _OnCuda:
    """What shape_of reads of a CUDA tensor (its device, shape and dtype), on a CPU machine."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        self.shape, self.device, self.dtype = torch.Size(shape), device, BF16


def test_shape_of_names_the_current_cuda_device_and_the_deterministic_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    docs = Documents(torch.tensor([0, 5, 5, 30]), torch.tensor([0, 5, 5, 30]), 25, 40)
    q, k, v = (_OnCuda((40, h, d), torch.device("cuda")) for h, d in ((8, 64), (2, 64), (2, 32)))
    got = shape_of(docs, q, k, v, 0.125)  # type: ignore[arg-type]
    assert got == GraphShape(batch=4, seqlen=64, heads=8, groups=2, dim=64, dim_v=32,
                             max_tokens=64, dtype=BF16, scale=0.125,
                             device=torch.device("cuda", 3), deterministic=False)  # fmt: skip
    q1 = _OnCuda((40, 8, 64), torch.device("cuda", 1))  # an explicit index is kept
    assert shape_of(docs, q1, k, v, 0.125).device == torch.device("cuda", 1)  # type: ignore[arg-type]
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert shape_of(docs, q, k, v, 0.125).deterministic is True  # type: ignore[arg-type]
    finally:
        torch.use_deterministic_algorithms(previous)


def test_a_refusal_crosses_processes_with_its_message_and_whether_it_lasts() -> None:
    import pickle

    for lasting in (True, False):
        again = pickle.loads(pickle.dumps(CudnnUnavailable("no engine", lasting=lasting)))
        assert type(again) is CudnnUnavailable
        assert (str(again), again.lasting) == ("no engine", lasting)


def test_the_frontends_not_supported_errors_are_its_own_type_and_not_implemented() -> None:
    from types import SimpleNamespace

    from megapack.attention.cudnn_graph import Frontend

    class GraphNotSupported(RuntimeError):
        pass

    module = SimpleNamespace(cudnnGraphNotSupportedError=GraphNotSupported)
    assert Frontend(module).not_supported() == (GraphNotSupported, NotImplementedError)
    assert Frontend(SimpleNamespace()).not_supported() == (NotImplementedError,)
    not_a_type = SimpleNamespace(cudnnGraphNotSupportedError="renamed")
    assert Frontend(not_a_type).not_supported() == (NotImplementedError,)


@needs_frontend
@pytest.mark.parametrize(("dtype", "io"), [(BF16, "BFLOAT16"), (torch.float16, "HALF")])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_described_graphs_compute_in_float32_on_io_of_the_inputs_dtype(
    kind: str, dtype: torch.dtype, io: str
) -> None:
    """What megapack asks of cuDNN beyond the node's parameters: the graph's data types (float32
    intermediates and compute), every tensor's uid its own (`UIDS`, never one the frontend
    numbers), the offsets and lengths read as contiguous int vectors, the softmax statistics
    backward reads laid out as forward writes them."""
    module = frontend().module
    s = shape(batch=8, seqlen=128, heads=16, groups=4, dim=128, dim_v=128, max_tokens=1024,
              dtype=dtype)  # fmt: skip
    graph, uids = describe(module, kind, s, handle=None)
    context = graph.context
    assert context.io_data_type == getattr(module.data_type, io)
    assert context.intermediate_data_type == context.compute_data_type == module.data_type.FLOAT
    (node,) = graph.nodes
    tensors = [t for t in (*node.inputs.values(), *node.outputs.values()) if t is not None]
    tensors += [t.ragged_offset for t in tensors if t.ragged_offset is not None]
    by_uid = {name: uid for name, uid in uids.items()}
    for t in tensors:
        if t.is_virtual:
            continue
        assert t.uid_assigned, t.name
        assert t.uid in by_uid.values(), t.name
        if list(t.dim)[1:] == [1, 1, 1]:  # offsets [B + 1] and lengths [B]: contiguous
            assert t.stride[0] == 1, t.name
    ragged = [t for t in tensors if t.ragged_offset is not None]
    assert {t.data_type for t in ragged} == {getattr(module.data_type, io)}
    stats = next(t for t in tensors if t.uid == UIDS["stats"])
    assert stats.dim == [8, 16, 128, 1] and stats.stride[:3] == [16 * 128, 128, 1]
    assert stats.data_type == module.data_type.FLOAT
