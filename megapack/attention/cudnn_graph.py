"""cuDNN's graphs for the ``cudnn`` backend (`megapack.attention.cudnn`): described, built in pairs
before any kernel runs, cached, and run on the current stream.

A graph is described with nvidia-cudnn-frontend's Python API (`describe`, which runs without a GPU
until ``validate``, so CPU tests check what megapack asks for), then validated, planned and built
once per `GraphShape` (`graphs`). A micro-batch that will backpropagate gets its forward and its
backward graph built together, before the forward kernel runs, so a refusal of either is found
while ``auto`` can still fall back (the forward has not run on cuDNN) and an explicit
``backend="cudnn"`` raises before any work is done.

What is remembered: a graph once built; a *lasting* refusal (`CudnnUnavailable.lasting`: the
frontend's "graph not supported", a description this frontend release cannot take, no frontend),
which depends only on the shape, dtype and versions, so it is raised again without a second
attempt. What is not: a *transient* failure (out of memory, a CUDA error, anything else), tried
again on the next call, up to `TRANSIENT_TRIES` times in a row before it counts as lasting; and a
graph asked for inside a CUDA-graph capture, which is never built there (``cudnnCreate`` and the
workspace query are not capturable): `megapack.core.errors.CaptureError` says to warm up eagerly.

Every graph reads and writes named tensors (`UIDS`; a graph's variant pack holds exactly its own):
q, k, v, o as ragged [B, H, S, D] views of THD tensors (offsets in elements, int64 [B + 1]), the
per-document real lengths of the queries and of the keys as two int32 [B] tensors (``seq_len_q``,
``seq_len_kv``, as Transformer Engine and the frontend's samples pass them), dense softmax
statistics [B, H, S, 1] (float32); backward adds dO, dQ, dK, dV.

``max_total_seq_len_q/kv`` (backward only, as in the frontend's ragged tests and TE): the tokens T
rounded up to a multiple of 64, at least 64 (`max_tokens_class`), the rule of the frontend's own
ragged tests (``test/python/sdpa/fp16.py``). It sizes backward's THD dQ accumulator in the
workspace (max_total_seq_len_q x H x D float32) and the dK/dV ones; the exact T, as before, left
no room for the 64-row tiles those tests provision. TE buckets it coarser (1,024, then powers of
two, then multiples of 32,768) because its token count changes with every batch; megapack's T is
fixed by the rows (a `megapack.StaticShape` is one class), so the tightest rounding costs no extra
graphs and the least workspace (T=14,398, 16 heads x 128: 118 MB of dQ accumulator, against
134 MB at TE's 16,384).

`Frontend` is the one place megapack meets cudnn-frontend's runtime (its module, one handle per
device, the stream binding); `frontend` returns it. CPU tests replace it with a stand-in that
executes the described graphs in float64 (tests/unit/cudnn_standin.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from megapack.core.capture import capturing
from megapack.core.errors import CaptureError

logger = logging.getLogger("megapack.attention")

TRANSIENT_TRIES = 3
"""Transient build failures of one graph in a row after which its refusal counts as lasting."""


class CudnnUnavailable(RuntimeError):
    """cuDNN's graph cannot be built or run for these inputs (the message says why).

    Attributes:
        lasting: True for a refusal that depends only on the shape, dtype and versions (remembered:
            ``auto`` never picks cudnn again in this process); False for a transient failure (an
            out-of-memory, a CUDA error), tried again on the next call.
    """

    def __init__(self, message: str, *, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unavailable, (str(self), self.lasting))


def _unavailable(message: str, lasting: bool) -> CudnnUnavailable:
    return CudnnUnavailable(message, lasting=lasting)


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What one cached pair of cuDNN graphs is built for (module docstring: the shape classes)."""

    batch: int
    """Documents B, a power of two (extra documents have length 0)."""
    seqlen: int
    """S, the longest document's class."""
    heads: int
    """Query heads H."""
    groups: int
    """Key/value heads G (G divides H)."""
    dim: int
    """Query/key head dim D."""
    dim_v: int
    """Value head dim."""
    max_tokens: int
    """``max_total_seq_len_q/kv``: the buffer's tokens T rounded by `max_tokens_class`."""
    dtype: torch.dtype
    scale: float
    device: torch.device
    """The tensors' device (``cuda:i``)."""
    deterministic: bool
    """Backward's deterministic algorithm (``torch.are_deterministic_algorithms_enabled()``)."""


def max_tokens_class(total: int) -> int:
    """``max_total_seq_len`` for a buffer of ``total`` tokens: a multiple of 64, at least 64.

    Example:
        >>> [max_tokens_class(t) for t in (0, 1, 40, 64, 65, 14398)]
        [64, 64, 64, 64, 128, 14400]
    """
    return max(64, -(-total // 64) * 64)


class Frontend:
    """cudnn-frontend's runtime as the cudnn backend uses it: the ``cudnn`` module, one handle per
    device, the stream binding, the frontend's "not supported" error. CPU tests replace it."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._handles: dict[torch.device, Any] = {}

    def handle(self, device: torch.device) -> Any:
        """The device's cuDNN handle, created once (``cudnnCreate``: not capturable)."""
        if device not in self._handles:
            with torch.cuda.device(device):
                self._handles[device] = self.module.create_handle()
        return self._handles[device]

    def bind(self, handle: Any, device: torch.device) -> None:
        """Point ``handle`` at the caller's current stream (the one a capture records)."""
        stream = torch.cuda.current_stream(device).cuda_stream
        self.module.set_stream(handle=handle, stream=stream)

    def not_supported(self) -> tuple[type[BaseException], ...]:
        """The exception types the frontend raises for a graph it does not support: its
        ``cudnnGraphNotSupportedError`` and ``NotImplementedError`` (the declines its plan walk
        treats as such, ``cudnn.engines.base.decline_types``)."""
        kind = getattr(self.module, "cudnnGraphNotSupportedError", None)
        return (kind, NotImplementedError) if isinstance(kind, type) else (NotImplementedError,)


@functools.cache
def frontend() -> Frontend | None:
    """nvidia-cudnn-frontend's `Frontend`, or None when ``import cudnn`` finds nothing."""
    try:
        import cudnn
    except (ImportError, OSError):
        return None
    return Frontend(cudnn)


class Graph:
    """A built cuDNN graph, its tensors' uids by name and its workspace size."""

    def __init__(self, graph: Any, uids: dict[str, int], workspace: int) -> None:
        self.graph, self.uids, self.workspace = graph, uids, workspace

    def run(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Execute on the current stream (capturable: no host read, no sync). ``tensors`` names
        every tensor of the graph; the variant pack holds exactly the graph's uids."""
        runtime = frontend()
        if runtime is None:
            raise CudnnUnavailable("nvidia-cudnn-frontend is not installed")
        handle = runtime.handle(device)
        runtime.bind(handle, device)
        workspace = torch.empty(max(self.workspace, 1), dtype=torch.uint8, device=device)
        pack = {uid: tensors[name] for name, uid in self.uids.items()}
        self.graph.execute(pack, workspace, handle=handle)


@dataclass(frozen=True, slots=True)
class Graphs:
    """The built graphs one micro-batch runs: forward, and backward when it will backpropagate."""

    forward: Graph
    backward: Graph | None


_graphs: dict[tuple[str, GraphShape], Graph | CudnnUnavailable] = {}
"""Built graphs and lasting refusals, by (kind, shape)."""
_transient: dict[tuple[str, GraphShape], int] = {}
"""Transient failures in a row, by (kind, shape)."""


def graphs(shape: GraphShape, *, backward: bool) -> Graphs:
    """The forward graph for ``shape`` and, with ``backward``, the backward one, both built (or
    taken from the cache) before either runs.

    Raises:
        CudnnUnavailable: cuDNN refuses either graph (``lasting`` says whether for good).
        CaptureError: a graph not built yet is asked for inside a CUDA-graph capture.
    """
    forward = graph("forward", shape)
    return Graphs(forward=forward, backward=graph("backward", shape) if backward else None)


def graph(kind: str, shape: GraphShape) -> Graph:
    """The built graph of ``kind`` ("forward" or "backward") for ``shape`` (module docstring:
    what is cached and what is tried again)."""
    key = (kind, shape)
    hit = _graphs.get(key)
    if isinstance(hit, Graph):
        return hit
    if hit is not None:
        raise hit
    if capturing():
        raise CaptureError(
            f"cuDNN's {kind} attention graph for {shape} is not built yet, and building it "
            "cannot be recorded in a CUDA-graph capture (cudnnCreate, plan building and its "
            "workspace query run on the host); warm up eagerly first: run the step, forward and "
            "backward, once outside the capture with the same shapes (GraphStep's warmup does)"
        )
    try:
        built = _build(kind, shape)
    except CudnnUnavailable as exc:
        if not exc.lasting:
            tries = _transient[key] = _transient.get(key, 0) + 1
            if tries < TRANSIENT_TRIES:
                raise
            exc = CudnnUnavailable(f"{exc} (failed {tries} times in a row: kept as lasting)")
        _transient.pop(key, None)
        _graphs[key] = exc
        raise exc from None
    _transient.pop(key, None)
    _graphs[key] = built
    logger.info("cudnn: built the %s graph for %s", kind, shape)
    return built


def _build(kind: str, shape: GraphShape) -> Graph:
    """Describe, validate, plan and build one graph; every failure a `CudnnUnavailable`."""
    runtime = frontend()
    if runtime is None:
        raise CudnnUnavailable(
            "nvidia-cudnn-frontend is not installed (pip install 'megapack[cudnn]')"
        )
    module = runtime.module
    where = f"cuDNN cannot build the {kind} graph for {shape}"
    try:
        handle = runtime.handle(shape.device)
    except Exception as exc:  # cudnnCreate: out of memory, a CUDA error
        raise CudnnUnavailable(
            f"{where}: creating the handle failed: {exc}", lasting=False
        ) from exc
    try:
        described, uids = describe(module, kind, shape, handle)
    except Exception as exc:  # this frontend release takes not what megapack asks for
        raise CudnnUnavailable(f"{where}: describing it failed: {exc}") from exc
    try:
        described.validate()
        described.build_operation_graph()
        described.create_execution_plans([module.heur_mode.A, module.heur_mode.FALLBACK])
        described.check_support()
        described.build_plans()
        workspace = int(described.get_workspace_size())
    except runtime.not_supported() as exc:  # shape, dtype, head dim or version: for good
        raise CudnnUnavailable(f"{where}: {exc}") from exc
    except Exception as exc:  # out of memory, a CUDA error, anything else: try again later
        raise CudnnUnavailable(f"{where}: {type(exc).__name__}: {exc}", lasting=False) from exc
    return Graph(described, uids, workspace)


UIDS = {
    "q": 1, "k": 2, "v": 3, "o": 4, "stats": 5, "dO": 6, "dQ": 7, "dK": 8, "dV": 9,
    "q_offsets": 20, "k_offsets": 21, "v_offsets": 22, "o_offsets": 23,
    "lengths_q": 24, "lengths_kv": 25,
}  # fmt: skip
"""The uid of every tensor a graph reads or writes (the same in both graphs)."""
FORWARD = ("q", "k", "v", "o", "stats", "q_offsets", "k_offsets", "v_offsets", "o_offsets",
           "lengths_q", "lengths_kv")  # fmt: skip
"""The tensors of the forward graph; the backward graph's add dO, dQ, dK and dV."""


def describe(module: Any, kind: str, shape: GraphShape, handle: Any) -> tuple[Any, dict[str, int]]:
    """The cuDNN graph of ``kind`` ("forward" or "backward") for ``shape``, described, not built,
    and the uids of its tensors by name.

    Runs without a GPU (the frontend's graph is a Python description until ``validate``), so
    CPU tests check what megapack asks cuDNN for.
    """
    io = module.data_type.BFLOAT16 if shape.dtype == torch.bfloat16 else module.data_type.HALF
    f32, i64, i32 = module.data_type.FLOAT, module.data_type.INT64, module.data_type.INT32
    g = module.pygraph(
        io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle
    )
    b, s, h, n = shape.batch, shape.seqlen, shape.heads, shape.groups

    def thd(name: str, heads: int, dim: int, offsets: Any) -> Any:
        """A ragged [B, heads, S, dim] view of a [T, heads, dim] tensor."""
        t = g.tensor(name=name, dim=[b, heads, s, dim], stride=[s * heads * dim, dim, heads * dim, 1],
                     data_type=io, uid=UIDS[name])  # fmt: skip
        t.set_ragged_offset(offsets)
        return t

    def ints(name: str, count: int, dtype: Any) -> Any:
        return g.tensor(name=name, dim=[count, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype,
                        uid=UIDS[name])  # fmt: skip

    off = {
        name: ints(name, b + 1, i64)
        for name in ("q_offsets", "k_offsets", "v_offsets", "o_offsets")
    }
    q = thd("q", h, shape.dim, off["q_offsets"])
    k = thd("k", n, shape.dim, off["k_offsets"])
    v = thd("v", n, shape.dim_v, off["v_offsets"])
    mask = {
        "attn_scale": shape.scale,
        "use_padding_mask": True,
        "seq_len_q": ints("lengths_q", b, i32),
        "seq_len_kv": ints("lengths_kv", b, i32),
        "diagonal_alignment": module.diagonal_alignment.TOP_LEFT,
        "diagonal_band_right_bound": 0,
    }
    o_dims = ([b, h, s, shape.dim_v], [s * h * shape.dim_v, shape.dim_v, h * shape.dim_v, 1])
    names = list(FORWARD)
    if kind == "forward":
        o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **mask)
        o.set_uid(UIDS["o"]).set_output(True).set_dim(o_dims[0]).set_stride(o_dims[1])
        o.set_data_type(io).set_ragged_offset(off["o_offsets"])
        stats.set_uid(UIDS["stats"]).set_output(True).set_data_type(f32)
        stats.set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1])
    else:
        o = thd("o", h, shape.dim_v, off["o_offsets"])
        d_o = thd("dO", h, shape.dim_v, off["o_offsets"])
        stats = g.tensor(name="stats", dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=f32,
                         uid=UIDS["stats"])  # fmt: skip
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=d_o,
                                     stats=stats, use_deterministic_algorithm=shape.deterministic,
                                     max_total_seq_len_q=shape.max_tokens,
                                     max_total_seq_len_kv=shape.max_tokens, **mask)  # fmt: skip
        for t, name, like, offsets in ((dq, "dQ", q, "q_offsets"), (dk, "dK", k, "k_offsets"),
                                       (dv, "dV", v, "v_offsets")):  # fmt: skip
            t.set_uid(UIDS[name]).set_output(True).set_dim(like.dim).set_stride(like.stride)
            t.set_data_type(io).set_ragged_offset(off[offsets])
        names += ["dO", "dQ", "dK", "dV"]
    return g, {name: UIDS[name] for name in names}
