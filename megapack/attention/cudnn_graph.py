"""cuDNN's graphs for the ``cudnn`` backend (`megapack.attention.cudnn`): described, built once per
`GraphShape`, cached, and run on the current stream.

A graph is described with nvidia-cudnn-frontend's Python API (`describe`, which runs without a GPU
until ``validate``, so CPU tests check what megapack asks for), then validated, planned and built
once per shape class (`graph`); a shape cuDNN refuses is remembered as `CudnnUnavailable` and raised
again without a second attempt. One cuDNN handle per device; its stream is set to the caller's
current stream before every execute, so the graphs run on the stream a CUDA-graph capture records.

Every graph reads and writes the same named tensors (`UIDS`): q, k, v, o as ragged [B, H, S, D]
views of THD tensors (offsets in elements, int64), per-document real lengths (int32), dense
softmax statistics [B, H, S, 1] (float32); backward adds dO, dQ, dK, dV.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

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


@functools.cache
def frontend() -> Any:
    """The ``cudnn`` module of nvidia-cudnn-frontend, or None when it is not installed."""
    try:
        import cudnn
    except (ImportError, OSError):
        return None
    return cudnn


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


def graph(kind: str, shape: GraphShape) -> Graph:
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
