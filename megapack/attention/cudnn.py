"""The ``cudnn`` backend: cuDNN's fused attention over ragged THD tensors, through cudnn-frontend.

cuDNN runs attention on Hopper with its own sm90 kernels (``sdpa_sm90_flash_fprop/bprop_wgmma``),
about 2x torch varlen's FlashAttention 2 per FLOP on an H200 (the kernels padded SDPA gets there).
Transformer Engine's fused attention reaches them for THD batches the same way this module does:
a cuDNN graph whose q, k, v and o are *ragged* (one [B, H, S, D] tensor whose rows start at
per-document offsets) with a padding mask of per-document lengths. The frontend is the pip
package ``nvidia-cudnn-frontend`` (``pip install megapack[cudnn]``, pinned `FRONTEND_PIN`: the
newest release with no required dependencies); cuDNN itself comes with torch.

A graph's dimensions are (documents B, longest document S, heads, head dims, tokens T); they are
quantised into shape classes so that few graphs are built and each is built once, then cached:

    B  documents (segments) rounded up to a power of two; the extra ones have length 0
    S  ``max_seqlen`` up to `megapack.core.buckets.length_class` (>= 64; < 1/8 above it)
    T  the buffer's token count (constant for packed rows: rows x seq_len)

A `megapack.StaticShape` is one class, so a captured step replays one graph. Per micro-batch,
everything the graph reads is derived on the device from the boundaries (kept in the
micro-batch's `megapack.attention.documents.Documents`, rebuilt inside a CUDA-graph capture):

    ragged offsets  cu_seqlens_padded (else cu_seqlens) x (heads x head dim), int64, [B + 1]
    lengths         real lengths (cu_seqlens diffs), int32, [B], zero for the extra documents

No host read, so no sync; padding and zero-length documents cost nothing (cuDNN skips tiles past
a document's length). Outputs and gradients at alignment-padding positions are zero. Softmax
statistics are kept dense ([B, H, S, 1] float32, what backward reads: 8 MB a layer at B=32,
H=16, S=4,096). Grouped-query attention is native (K/V heads are not repeated).

Worked example: documents of 3 and 5 tokens (buffer ``[0, 3, 8]``), 4 heads of 64: B class 2,
S class 64, q offsets ``[0, 768, 2048]`` (x 256 elements a token), lengths ``[3, 5]``.

Where a graph cannot be built or run (no frontend, cuDNN < 9.6, a GPU older than sm90, a dtype or
head dim cuDNN refuses, a failed build), `unavailable` says why: ``backend="auto"`` falls back
with the reason logged once; an explicit ``backend="cudnn"`` raises it.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from megapack.attention.documents import Documents
from megapack.core.buckets import length_class

FRONTEND_PIN = "1.28.0"
"""The nvidia-cudnn-frontend release megapack is built against (``megapack[cudnn]``)."""
MIN_CUDNN = 90600
"""cuDNN 9.6: int64 ragged offsets, ragged backward on Hopper."""
HALF = (torch.float16, torch.bfloat16)
logger = logging.getLogger("megapack.attention")


class CudnnUnavailable(RuntimeError):
    """cuDNN's graph cannot be built or run for these inputs (the message says why)."""


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What one cached cuDNN graph is built for (module docstring: the shape classes)."""

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
    total: int
    """Tokens T of the buffer (the ragged tensors' token axis)."""
    dtype: torch.dtype
    scale: float
    device: int
    """CUDA device index."""
    deterministic: bool
    """Backward's deterministic algorithm (``torch.are_deterministic_algorithms_enabled()``)."""


def batch_class(n: int) -> int:
    """The power of two >= n (>= 1): the documents a graph is built for.

    Example:
        >>> [batch_class(n) for n in (1, 2, 3, 9, 82)]
        [1, 2, 4, 16, 128]
    """
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def seqlen_class(longest: int) -> int:
    """The S a graph is built for: ``length_class(longest)``, at least 64.

    Example:
        >>> [seqlen_class(n) for n in (5, 100, 4096, 14398)]
        [64, 112, 4096, 15360]
    """
    return max(64, length_class(longest))


def shape_of(
    docs: Documents, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> GraphShape:
    """The `GraphShape` of a micro-batch (host values only: the boundaries' size, ``max_seqlen``)."""
    return GraphShape(
        batch=batch_class(docs.cu_buffer.shape[0] - 1),
        seqlen=seqlen_class(docs.max_seqlen),
        heads=q.shape[1],
        groups=k.shape[1],
        dim=q.shape[2],
        dim_v=v.shape[2],
        total=q.shape[0],
        dtype=q.dtype,
        scale=float(scale),
        device=q.device.index if q.device.index is not None else torch.cuda.current_device(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )


@dataclass(frozen=True, slots=True)
class Offsets:
    """The per-micro-batch device tensors a graph reads besides q, k, v (module docstring)."""

    q: torch.Tensor
    """[B + 1, 1, 1, 1] int64: token offsets x H x D (also o's when D == dim_v)."""
    kv: torch.Tensor
    """[B + 1, 1, 1, 1] int64: x G x D (also v's when D == dim_v)."""
    v: torch.Tensor
    o: torch.Tensor
    lengths: torch.Tensor
    """[B, 1, 1, 1] int32 real lengths."""


def offsets_of(docs: Documents, shape: GraphShape) -> Offsets:
    """`Offsets` for ``shape``, once per micro-batch (kept in ``docs.memo``; no host read).

    Example:
        >>> docs = Documents(torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8]), 5, 8)
        >>> shape = GraphShape(batch=2, seqlen=64, heads=4, groups=4, dim=64, dim_v=64, total=8,
        ...     dtype=torch.bfloat16, scale=0.125, device=0, deterministic=False)
        >>> off = offsets_of(docs, shape)
        >>> off.q.flatten().tolist(), off.lengths.flatten().tolist()
        ([0, 768, 2048], [3, 5])
    """
    key = ("cudnn", shape.batch, shape.heads, shape.groups, shape.dim, shape.dim_v)
    hit = docs.memo.get(key)
    if hit is not None:
        return hit
    extra = shape.batch - (docs.cu_buffer.shape[0] - 1)
    cu = docs.cu_buffer.to(torch.int64)
    real = (docs.cu_real[1:] - docs.cu_real[:-1]).to(torch.int32)
    if extra:
        cu = torch.cat([cu, cu[-1:].expand(extra)])
        real = torch.cat([real, real.new_zeros(extra)])
    per = (shape.heads * shape.dim, shape.groups * shape.dim, shape.groups * shape.dim_v)
    q, kv, v = ((cu * n).view(-1, 1, 1, 1) for n in per)
    o = q if shape.dim_v == shape.dim else (cu * (shape.heads * shape.dim_v)).view(-1, 1, 1, 1)
    docs.memo[key] = out = Offsets(q=q, kv=kv, v=kv if shape.dim_v == shape.dim else v, o=o,
                                   lengths=real.view(-1, 1, 1, 1))  # fmt: skip
    return out


@functools.cache
def frontend() -> Any:
    """The ``cudnn`` module of nvidia-cudnn-frontend, or None when it is not installed."""
    try:
        import cudnn
    except (ImportError, OSError):
        return None
    return cudnn


def unavailable(
    device: torch.device, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """Why the cudnn backend cannot run here (None: it can); cheap, checked before any graph."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "cudnn runs on CUDA only"
    module = frontend()
    if module is None:
        return f"nvidia-cudnn-frontend is not installed (pip install nvidia-cudnn-frontend=={FRONTEND_PIN})"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"cuDNN's ragged (THD) attention needs sm90 or newer; this GPU is sm{major}{minor}"
    version = cudnn_version()
    if version is None or version < MIN_CUDNN:
        return f"cuDNN {version} is older than 9.6 (ragged offsets of int64)"
    if dtype not in HALF:
        return "cuDNN's fused attention takes float16/bfloat16 only"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"cuDNN's fused attention needs a head dim that is a multiple of 8 and <= 256, got {head_dim}"
    return None


@functools.cache
def cudnn_version() -> int | None:
    """The cuDNN backend's version as an int (9.19.0 -> 91900), or None without cuDNN."""
    module = frontend()
    if module is not None:
        try:
            return int(module.backend_version())
        except Exception:  # the frontend could not find libcudnn: ask torch
            pass
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return None if version is None else int(version)


def cudnn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float, dropout: float
) -> torch.Tensor:
    """Causal attention within every document of ``docs`` through cuDNN's ragged graphs.

    Raises:
        CudnnUnavailable: cuDNN cannot take these inputs (the reason); ``auto`` falls back.
    """
    why = unavailable(q.device, q.dtype, q.shape[2])
    if why is not None:
        raise CudnnUnavailable(why)
    if dropout > 0.0:
        raise CudnnUnavailable("the cudnn backend has no attention dropout")
    shape = shape_of(docs, q, k, v, scale)
    if docs.max_seqlen > shape.seqlen or docs.cu_buffer.shape[0] - 1 > shape.batch:
        raise AssertionError("shape classes hold every micro-batch")  # internal invariant
    offsets = offsets_of(docs, shape)
    return _CudnnAttention.apply(q, k, v, offsets, shape, docs.padded)


class _CudnnAttention(torch.autograd.Function):
    """Forward and backward through the cached graphs of one `GraphShape`."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        offsets: Offsets,
        shape: GraphShape,
        padded: bool,
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        new = torch.zeros if padded else torch.empty
        out = new(shape.total, shape.heads, shape.dim_v, dtype=q.dtype, device=q.device)
        stats = torch.empty(
            shape.batch, shape.heads, shape.seqlen, 1, dtype=torch.float32, device=q.device
        )
        graph = _graph("forward", shape)
        graph.run(
            {"q": q, "k": k, "v": v, "o": out, "stats": stats, **_offset_tensors(offsets)},
            q.device,
        )
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.offsets, ctx.shape, ctx.padded = offsets, shape, padded
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, stats = ctx.saved_tensors
        shape, new = ctx.shape, torch.zeros_like if ctx.padded else torch.empty_like
        dq, dk, dv = new(q), new(k), new(v)
        graph = _graph("backward", shape)
        tensors = {"q": q, "k": k, "v": v, "o": out, "stats": stats, "dO": grad.contiguous(),
                   "dQ": dq, "dK": dk, "dV": dv, **_offset_tensors(ctx.offsets)}  # fmt: skip
        graph.run(tensors, q.device)
        return dq, dk, dv, None, None, None


def _offset_tensors(offsets: Offsets) -> dict[str, torch.Tensor]:
    return {
        "q_offsets": offsets.q,
        "k_offsets": offsets.kv,
        "v_offsets": offsets.v,
        "o_offsets": offsets.o,
        "lengths": offsets.lengths,
    }


class Graph:
    """A built cuDNN graph, its tensors' uids by name and its workspace size."""

    def __init__(self, graph: Any, uids: dict[str, int], workspace: int) -> None:
        self.graph, self.uids, self.workspace = graph, uids, workspace

    def run(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Execute on the current stream (capturable: no host read, no sync)."""
        module = frontend()
        handle = _handle(device.index if device.index is not None else torch.cuda.current_device())
        module.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
        workspace = torch.empty(max(self.workspace, 1), dtype=torch.uint8, device=device)
        pack = {self.uids[name]: t for name, t in tensors.items() if name in self.uids}
        self.graph.execute(pack, workspace, handle=handle)


_graphs: dict[tuple[str, GraphShape], Graph | CudnnUnavailable] = {}


def _graph(kind: str, shape: GraphShape) -> Graph:
    """The built graph of ``kind`` for ``shape``: built once, failures remembered and raised."""
    key = (kind, shape)
    hit = _graphs.get(key)
    if hit is None:
        try:
            module = frontend()
            handle = _handle(shape.device)
            graph, uids = describe(module, kind, shape, handle)
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([module.heur_mode.A, module.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
            hit = Graph(graph, uids, int(graph.get_workspace_size()))
            logger.info("cudnn: built the %s graph for %s", kind, shape)
        except Exception as exc:  # a shape or build cuDNN refuses: say which, once
            hit = CudnnUnavailable(f"cuDNN cannot build the {kind} graph for {shape}: {exc}")
        _graphs[key] = hit
    if isinstance(hit, CudnnUnavailable):
        raise hit
    return hit


UIDS = {
    "q": 1, "k": 2, "v": 3, "o": 4, "stats": 5, "dO": 6, "dQ": 7, "dK": 8, "dV": 9,
    "q_offsets": 20, "k_offsets": 21, "v_offsets": 22, "o_offsets": 23, "lengths": 24,
}  # fmt: skip
"""The uid of every tensor a graph reads or writes (the same in both graphs)."""


def describe(module: Any, kind: str, shape: GraphShape, handle: Any) -> tuple[Any, dict[str, int]]:
    """The cuDNN graph of ``kind`` ("forward" or "backward") for ``shape``, described, not built.

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
    lengths = ints("lengths", b, i32)
    q = thd("q", h, shape.dim, off["q_offsets"])
    k = thd("k", n, shape.dim, off["k_offsets"])
    v = thd("v", n, shape.dim_v, off["v_offsets"])
    causal = {
        "attn_scale": shape.scale,
        "use_padding_mask": True,
        "seq_len_q": lengths,
        "seq_len_kv": lengths,
        "max_total_seq_len_q": shape.total,
        "max_total_seq_len_kv": shape.total,
        "diagonal_alignment": module.diagonal_alignment.TOP_LEFT,
        "diagonal_band_right_bound": 0,
    }
    o_dims = ([b, h, s, shape.dim_v], [s * h * shape.dim_v, shape.dim_v, h * shape.dim_v, 1])
    if kind == "forward":
        o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **causal)
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
                                     **causal)  # fmt: skip
        for t, name, like, offsets in ((dq, "dQ", q, "q_offsets"), (dk, "dK", k, "k_offsets"),
                                       (dv, "dV", v, "v_offsets")):  # fmt: skip
            t.set_uid(UIDS[name]).set_output(True).set_dim(like.dim).set_stride(like.stride)
            t.set_data_type(io).set_ragged_offset(off[offsets])
    return g, UIDS


@functools.cache
def _handle(device: int) -> Any:
    """One cuDNN handle per CUDA device (its stream is set before every execute)."""
    module = frontend()
    with torch.cuda.device(device):
        return module.create_handle()
