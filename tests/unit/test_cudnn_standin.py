"""The cudnn backend end to end on CPU, through a stand-in for cuDNN's runtime
(tests/unit/cudnn_standin.py): megapack's own code describes the graphs with the real frontend,
builds them, derives the offsets and lengths, fills the variant packs and runs autograd; the
stand-in executes the described graphs the way cuDNN reads a variant pack, in float64.

Hooked in at the one seam where megapack meets the frontend's runtime (`cudnn_graph.frontend`);
the other patch is `cudnn.unavailable`, the environment check (CUDA, sm90, cuDNN version) this
CPU cannot pass. Checked: equal to the per-document reference forward and backward (16 / 4 heads x
128, bf16 in, zero-length documents in the middle and at the end, T below 64 and not a multiple of
64, boundaries ending before T, padded boundaries), exact zeros where no real token is, no host
read; both graphs built before any kernel runs, so a refusal falls back (auto) or raises (explicit)
with nothing executed; what is cached and what is tried again; no build inside a capture.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch

from megapack.attention import choice
from megapack.attention.cudnn import unavailable as ENVIRONMENT_CHECK  # the fixture patches it
from megapack.attention.cudnn_graph import TRANSIENT_TRIES, CudnnUnavailable
from megapack.attention.documents import Documents
from megapack.attention.kernels import KERNELS, attend
from megapack.core import capture
from megapack.core.errors import CaptureError
from megapack.testing.host_reads import host_reads
from tests.unit.cudnn_standin import StandinFrontend, install

pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend describes the graphs")

HEADS, GROUPS, DIM = 16, 4, 128
SCALE = DIM**-0.5
CASES = {  # (T, cu_seqlens, cu_seqlens_padded or None)
    "T40-zero-length-middle-and-end": (40, [0, 5, 5, 17, 40, 40], None),
    "T100-ends-at-90-zero-length-middle": (100, [0, 30, 30, 61, 90], None),
    "T24-padded-zero-length-middle-and-end": (24, [0, 3, 3, 9, 9], [0, 8, 8, 24, 24]),
    "T130-one-document": (130, [0, 130], None),
}


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> StandinFrontend:
    return install(monkeypatch)


def documents(case: str) -> Documents:
    total, real, buffer = CASES[case]
    cu = torch.tensor(real, dtype=torch.int32)
    pad = cu if buffer is None else torch.tensor(buffer, dtype=torch.int32)
    return Documents(cu, pad, max(1, int(pad.diff().max())), total)


def inputs(total: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(total, h, DIM, generator=g).to(torch.bfloat16) for h in (HEADS, GROUPS, GROUPS)
    )
    grad = torch.randn(total, HEADS, DIM, generator=g).to(torch.bfloat16)
    return q, k, v, grad


def run(kernel: str, docs: Documents, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = KERNELS[kernel](q, k, v, docs, SCALE, 0.0)
    out.backward(grad.to(out.dtype))
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


def reference(docs: Documents, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Per-document causal attention in float64 (the sdpa backend) of the same bf16 values."""
    return run("sdpa", docs, q.double(), k.double(), v.double(), grad.double())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("case", list(CASES))
def test_cudnn_runs_end_to_end_equal_to_the_per_document_reference(
    standin: StandinFrontend, case: str
) -> None:
    docs = documents(case)
    q, k, v, grad = inputs(docs.total, seed=len(case))
    with host_reads() as reads:
        got = run("cudnn", docs, q, k, v, grad)
    assert reads.by_module() == {}, reads.report()
    assert standin.built == ["forward", "backward"] and standin.executed == ["forward", "backward"]
    want = reference(documents(case), q, k, v, grad)
    keep = docs.kept()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a[~keep], torch.zeros_like(a[~keep])), (
            f"{name}: not zero off the documents"
        )
        error = relative_error(a[keep], b[keep])
        assert error < 1e-2, f"{name}: {error:.2e} of the largest value off the reference"


def test_a_second_micro_batch_reuses_the_graphs(standin: StandinFrontend) -> None:
    for case in ("T40-zero-length-middle-and-end", "T40-zero-length-middle-and-end"):
        docs = documents(case)
        q, k, v, grad = inputs(docs.total, seed=1)
        run("cudnn", docs, q, k, v, grad)
    assert standin.built == ["forward", "backward"]
    assert standin.executed == ["forward", "backward"] * 2
    with torch.no_grad():  # forward only: no backward graph asked for, none executed
        docs = documents("T100-ends-at-90-zero-length-middle")
        KERNELS["cudnn"](*inputs(100, seed=2)[:3], docs, SCALE, 0.0)
    assert standin.built == ["forward", "backward", "forward"]


def not_supported(kind: str) -> BaseException:
    import cudnn as frontend

    return frontend.cudnnGraphNotSupportedError(f"no engine for this {kind} graph")


@pytest.mark.parametrize("refused", ["forward", "backward"])
def test_a_refused_graph_falls_back_before_any_cudnn_kernel_runs(
    standin: StandinFrontend, refused: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The backward graph is built with the forward one: a refusal of either comes before the
    forward ran on cuDNN, so auto runs the whole call, forward and backward, on its fallback."""
    standin.refuse[refused] = not_supported(refused)
    docs = documents("T40-zero-length-middle-and-end")
    q, k, v, grad = inputs(40, seed=3)
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with caplog.at_level(logging.WARNING, logger="megapack.attention"):
        ran, out = attend("cudnn", qs, ks, vs, docs, SCALE, 0.0, auto=True, training=True)
        out.backward(grad)
        ran_again, _ = attend("cudnn", qs, ks, vs, docs, SCALE, 0.0, auto=True, training=True)
    assert ran == ran_again == "bucketed" and standin.executed == []
    want = run("bucketed", documents("T40-zero-length-middle-and-end"), q, k, v, grad)
    for a, b in zip((out, qs.grad, ks.grad, vs.grad), want, strict=True):
        torch.testing.assert_close(a, b)
    warnings = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warnings) == 1 and f"cannot build the {refused} graph" in warnings[0]
    assert standin.built == ([] if refused == "forward" else ["forward"])  # never tried again
    with pytest.raises(
        ValueError, match=f"'cudnn' cannot run here: cuDNN cannot build the {refused}"
    ):
        attend("cudnn", qs, ks, vs, docs, SCALE, 0.0, auto=False, training=True)
    assert standin.executed == []


def test_a_transient_failure_is_tried_again_and_a_lasting_one_is_not(
    standin: StandinFrontend,
) -> None:
    docs = documents("T40-zero-length-middle-and-end")
    q, k, v, _ = inputs(40, seed=4)
    standin.refuse["forward"] = torch.OutOfMemoryError("CUDA out of memory (building plans)")
    with pytest.raises(CudnnUnavailable, match="OutOfMemoryError") as caught:
        KERNELS["cudnn"](q, k, v, docs, SCALE, 0.0)
    assert caught.value.lasting is False
    ran, _ = attend("cudnn", q, k, v, docs, SCALE, 0.0, auto=True, training=False)
    assert ran == "bucketed" and "cudnn" not in choice._failed  # this call only
    del standin.refuse["forward"]  # the memory came back: the next call builds and runs
    ran, _ = attend("cudnn", q, k, v, docs, SCALE, 0.0, auto=True, training=False)
    assert ran == "cudnn" and standin.executed == ["forward"]

    other = documents("T100-ends-at-90-zero-length-middle")  # another shape class
    q2, k2, v2, _ = inputs(100, seed=5)
    standin.refuse["forward"] = RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")
    with pytest.raises(ValueError, match="a transient failure: the next call tries again"):
        attend("cudnn", q2, k2, v2, other, SCALE, 0.0, auto=False, training=False)
    for attempt in range(1, TRANSIENT_TRIES):
        with pytest.raises(CudnnUnavailable) as caught:
            KERNELS["cudnn"](q2, k2, v2, other, SCALE, 0.0)
        assert caught.value.lasting is (attempt == TRANSIENT_TRIES - 1)
    assert "failed 3 times in a row" in str(caught.value)
    del standin.refuse["forward"]
    with pytest.raises(CudnnUnavailable, match="failed 3 times in a row"):  # now remembered
        KERNELS["cudnn"](q2, k2, v2, other, SCALE, 0.0)


@contextlib.contextmanager
def faked_capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        m.setattr(capture, "_runtime_capture_id", lambda: 9)
        yield


def test_no_graph_is_built_inside_a_capture_and_the_failure_is_not_remembered(
    standin: StandinFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, v, grad = inputs(40, seed=6)
    for auto in (True, False):
        with faked_capture(monkeypatch), pytest.raises(CaptureError, match="warm up eagerly"):
            attend("cudnn", q, k, v, documents("T40-zero-length-middle-and-end"), SCALE, 0.0,
                   auto=auto, training=False)  # fmt: skip
    assert standin.built == [] and choice._failed == {}
    with torch.no_grad():  # an eager warm-up without gradients builds the forward graph only
        KERNELS["cudnn"](q, k, v, documents("T40-zero-length-middle-and-end"), SCALE, 0.0)
    qs = q.clone().requires_grad_()
    with faked_capture(monkeypatch), pytest.raises(CaptureError, match="backward attention graph"):
        KERNELS["cudnn"](qs, k, v, documents("T40-zero-length-middle-and-end"), SCALE, 0.0)
    assert standin.executed == ["forward"]  # the capture's forward never ran
    run("cudnn", documents("T40-zero-length-middle-and-end"), q, k, v, grad)  # eager: builds it
    with faked_capture(monkeypatch):  # built: the capture runs them
        got = run("cudnn", documents("T40-zero-length-middle-and-end"), q, k, v, grad)
    assert standin.built == ["forward", "backward"]
    want = reference(documents("T40-zero-length-middle-and-end"), q, k, v, grad)
    assert relative_error(got[0], want[0]) < 1e-2


# ---- what mutation testing found unguarded (docs/records/mutation.md, 2026-11-28) -------------


def test_the_environment_check_sees_the_inputs_dtype_and_head_dim(
    standin: StandinFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cudnn.unavailable` as on a Hopper GPU (this CPU's device type aside): bf16 with a head
    dim of 128 runs; a head dim cuDNN does not take, or float32, is refused before any build."""
    from megapack.attention import cudnn
    from tests.unit.test_cudnn import hopper

    monkeypatch.setattr(choice, "installed_here", lambda: hopper())
    monkeypatch.setattr(cudnn, "unavailable", lambda device, dtype, head_dim=None: (
        ENVIRONMENT_CHECK(torch.device("cuda", 0), dtype, head_dim)))  # fmt: skip
    docs = documents("T40-zero-length-middle-and-end")
    q, k, v, grad = inputs(40, seed=3)
    run("cudnn", docs, q, k, v, grad)  # passes the check
    narrow = [x[..., :100].contiguous() for x in (q, k, v)]
    with pytest.raises(CudnnUnavailable) as caught:
        KERNELS["cudnn"](*narrow, docs, SCALE, 0.0)
    assert str(caught.value) == (
        "cuDNN's fused attention needs a head dim that is a multiple of 8 and <= 256, got 100"
    )
    with pytest.raises(CudnnUnavailable, match="takes float16/bfloat16 only"):
        KERNELS["cudnn"](q.float(), k.float(), v.float(), docs, SCALE, 0.0)
    assert standin.built == ["forward", "backward"]  # only the passing call built anything


def test_attention_dropout_is_refused_before_any_build(standin: StandinFrontend) -> None:
    q, k, v, _ = inputs(40, seed=4)
    for dropout in (0.1, 1.0):
        with pytest.raises(CudnnUnavailable) as caught:
            KERNELS["cudnn"](q, k, v, documents("T40-zero-length-middle-and-end"), SCALE, dropout)
        assert str(caught.value) == "the cudnn backend has no attention dropout"
    assert standin.built == []


def test_inputs_that_need_no_gradient_build_the_forward_graph_only(
    standin: StandinFrontend,
) -> None:
    """Gradients enabled, but nothing to backpropagate into (a frozen layer, an evaluation
    without no_grad): the backward graph is not built, so its refusal cannot stop the forward."""
    q, k, v, _ = inputs(40, seed=5)
    assert torch.is_grad_enabled() and not q.requires_grad
    out = KERNELS["cudnn"](q, k, v, documents("T40-zero-length-middle-and-end"), SCALE, 0.0)
    assert standin.built == ["forward"] and not out.requires_grad


def test_a_document_exactly_at_a_shape_class_runs(standin: StandinFrontend) -> None:
    """The longest document exactly 64 tokens (its class) and 4 documents (a power of two)."""
    cu = torch.tensor([0, 64, 70, 71, 80], dtype=torch.int32)
    docs = Documents(cu, cu, 64, 80)
    q, k, v, grad = inputs(80, seed=6)
    got = run("cudnn", docs, q, k, v, grad)
    want = reference(Documents(cu, cu, 64, 80), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert relative_error(a, b) < 1e-2, name


def test_graphs_are_described_on_the_devices_own_handle_with_the_fallback_heuristics(
    standin: StandinFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every graph is described with the one handle per device megapack creates (not one the
    frontend would make per graph), and plans are asked of heuristics A, then FALLBACK."""
    import cudnn as real

    from tests.unit import cudnn_standin

    handles, modes = [], []
    describe_on = standin.module.pygraph

    def pygraph(**kwargs: object) -> object:
        handles.append(kwargs.get("handle"))
        return describe_on(**kwargs)

    plans = cudnn_standin._Graph.create_execution_plans

    def create_execution_plans(self: object, asked: object) -> None:
        modes.append(asked)
        plans(self, asked)  # type: ignore[arg-type]

    monkeypatch.setattr(standin.module, "pygraph", pygraph)
    monkeypatch.setattr(cudnn_standin._Graph, "create_execution_plans", create_execution_plans)
    docs = documents("T40-zero-length-middle-and-end")
    run("cudnn", docs, *inputs(40, seed=7))
    device = torch.device("cpu")
    assert handles == [standin.handle(device)] * 2 and handles[0].device == device
    assert modes == [[real.heur_mode.A, real.heur_mode.FALLBACK]] * 2


def test_a_handle_that_cannot_be_created_is_a_transient_failure(
    standin: StandinFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(device: torch.device) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory (cudnnCreate)")

    docs = documents("T40-zero-length-middle-and-end")
    q, k, v, _ = inputs(40, seed=8)
    with monkeypatch.context() as m:
        m.setattr(standin, "handle", out_of_memory)
        with pytest.raises(CudnnUnavailable) as caught:
            KERNELS["cudnn"](q, k, v, docs, SCALE, 0.0)
    shape = caught.value.args[0].split(": creating the handle failed: ")
    assert shape[0].startswith("cuDNN cannot build the forward graph for GraphShape(")
    assert shape[1] == "CUDA out of memory (cudnnCreate)" and caught.value.lasting is False
    KERNELS["cudnn"](q, k, v, docs, SCALE, 0.0)  # the handle comes: built and run
    assert standin.built == ["forward"]


def test_a_graph_the_frontend_cannot_describe_or_a_missing_frontend_is_refused_for_good(
    standin: StandinFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megapack.attention import cudnn_graph

    docs = documents("T40-zero-length-middle-and-end")
    q, k, v, _ = inputs(40, seed=9)

    def old_frontend(*args: object) -> object:
        raise TypeError("sdpa() got an unexpected keyword argument 'seq_len_kv'")

    with monkeypatch.context() as m:
        m.setattr(cudnn_graph, "describe", old_frontend)
        with pytest.raises(CudnnUnavailable) as caught:
            KERNELS["cudnn"](q, k, v, docs, SCALE, 0.0)
    head, why = str(caught.value).split(": describing it failed: ")
    assert head.startswith("cuDNN cannot build the forward graph for GraphShape(")
    assert why == "sdpa() got an unexpected keyword argument 'seq_len_kv'"
    assert caught.value.lasting is True
    with pytest.raises(CudnnUnavailable, match="describing it failed"):  # remembered
        KERNELS["cudnn"](q, k, v, docs, SCALE, 0.0)

    monkeypatch.setattr(cudnn_graph, "frontend", lambda: None)
    monkeypatch.setattr(cudnn_graph, "_graphs", {})
    with pytest.raises(CudnnUnavailable) as caught:
        KERNELS["cudnn"](q, k, v, docs, SCALE, 0.0)
    assert str(caught.value) == (
        "nvidia-cudnn-frontend is not installed (pip install 'megapack[cudnn]')"
    )
    assert caught.value.lasting is True


def test_the_frontends_not_supported_error_is_a_lasting_refusal(standin: StandinFrontend) -> None:
    import cudnn as real

    docs = documents("T40-zero-length-middle-and-end")
    q, k, v, _ = inputs(40, seed=10)
    standin.refuse["forward"] = real.cudnnGraphNotSupportedError("no engine for this graph")
    with pytest.raises(CudnnUnavailable) as caught:
        KERNELS["cudnn"](q, k, v, docs, SCALE, 0.0)
    assert caught.value.lasting is True and str(caught.value).endswith(": no engine for this graph")
    del standin.refuse["forward"]
    with pytest.raises(CudnnUnavailable, match="no engine for this graph"):  # not tried again
        KERNELS["cudnn"](q, k, v, docs, SCALE, 0.0)
    assert standin.built == []


def test_a_build_inside_a_capture_says_to_warm_up_naming_the_graph(
    standin: StandinFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megapack.attention.cudnn import shape_of

    docs = documents("T40-zero-length-middle-and-end")
    q, k, v, _ = inputs(40, seed=11)
    with faked_capture(monkeypatch), pytest.raises(CaptureError) as caught:
        KERNELS["cudnn"](q, k, v, docs, SCALE, 0.0)
    assert str(caught.value) == (
        f"cuDNN's forward attention graph for {shape_of(docs, q, k, v, SCALE)} is not built yet, "
        "and building it cannot be recorded in a CUDA-graph capture (cudnnCreate, plan building "
        "and its workspace query run on the host); warm up eagerly first: run the step, forward "
        "and backward, once outside the capture with the same shapes (GraphStep's warmup does)"
    )
