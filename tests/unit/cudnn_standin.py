"""A CPU stand-in for cuDNN's runtime, so that `megapack.attention.cudnn` runs end to end on CPU.

cudnn-frontend describes graphs on CPU but cannot build or run them there (lowering calls
``cudnnCreate``). `StandinFrontend` replaces `megapack.attention.cudnn_graph.Frontend`, the one
seam where megapack meets the frontend's runtime (handle, stream, graph building and ``execute``):
graphs are still *described* by the real installed frontend (its ``pygraph``, ``tensor``,
``sdpa``, ``sdpa_backward``); building is bookkeeping (with refusals a test can inject), and
``execute`` reads the variant pack the way cuDNN does and computes attention in float64:

* every tensor is read and written through its data pointer only, in the dtype, dims and strides
  the *graph* declares (the torch tensor's own shape and strides are ignored, as cuDNN ignores
  them); reading or writing past the end of the memory behind a pointer is an error;
* a ragged tensor's document b starts at token ``offsets[b] x ragged_offset_multiplier / stride[2]``
  (its offsets are in elements; a start that is not a whole token is an error), and row s of it
  at element ``start x stride[2] + s x stride[2] + h x stride[1] + d x stride[3]``;
* ``seq_len_q`` / ``seq_len_kv`` give each document's rows; rows at or past them are neither read
  nor written (so what megapack does not zero stays as it was);
* the mask is the padding mask plus the diagonal band: key j is allowed for query i when
  ``j - i <= right_bound`` (top-left alignment; bottom-right adds ``len_kv - len_q``), no left
  bound; grouped-query attention maps query head h to key/value head ``h // (H / G)``;
* forward writes o and the softmax statistics (log-sum-exp of the scaled scores, float32);
  backward reads them back (P = exp(scores - stats)), and accumulates dQ in float32 in the
  *workspace* it was given, laid out as the frontend's THD dQ accumulator (dQ's strides and
  ragged offsets, ``max_total_seq_len_q`` rows; BHSD without it), then writes dQ, dK and dV;
* the variant pack must hold exactly the graph's uids (a missing or a foreign uid is an error).

Everything it reads or writes is counted (`StandinFrontend.executed`, ``built``) for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from megapack.attention.cudnn_graph import Frontend

_DTYPES = ("BFLOAT16", "HALF", "FLOAT", "INT64", "INT32")
_TORCH = {
    "BFLOAT16": torch.bfloat16,
    "HALF": torch.float16,
    "FLOAT": torch.float32,
    "INT64": torch.int64,
    "INT32": torch.int32,
}


def install(monkeypatch: Any) -> StandinFrontend:
    """Put a fresh `StandinFrontend` in place for one test (``monkeypatch``): at the seam
    (`megapack.attention.cudnn_graph.frontend`), with empty graph caches, and past the environment
    check this CPU cannot pass (`megapack.attention.cudnn.unavailable`: CUDA, sm90, cuDNN >= 9.6)."""
    from megapack.attention import choice, cudnn, cudnn_graph

    runtime = StandinFrontend()
    monkeypatch.setattr(cudnn_graph, "frontend", lambda: runtime)
    monkeypatch.setattr(cudnn_graph, "_graphs", {})
    monkeypatch.setattr(cudnn_graph, "_transient", {})
    monkeypatch.setattr(cudnn, "unavailable", lambda *args, **kwargs: None)
    monkeypatch.setattr(choice, "_failed", {})
    return runtime


class StandinError(RuntimeError):
    """What real cuDNN would do wrong, or refuse, with this variant pack or description."""


@dataclass
class StandinHandle:
    device: torch.device
    binds: int = 0
    """Times a stream was bound to it (megapack binds before every execute)."""


class StandinFrontend(Frontend):
    """`megapack.attention.cudnn_graph.Frontend` with cuDNN's runtime replaced (module docstring).

    Args:
        refuse: kind ("forward", "backward") -> the exception ``check_support`` raises for it.
    """

    def __init__(self, refuse: dict[str, BaseException] | None = None) -> None:
        import cudnn

        super().__init__(_Module(cudnn, self))
        self.refuse = dict(refuse or {})
        self.built: list[str] = []
        """Kinds built, in order."""
        self.executed: list[str] = []
        """Kinds executed, in order."""

    def handle(self, device: torch.device) -> StandinHandle:
        if device not in self._handles:
            self._handles[device] = StandinHandle(device)
        return self._handles[device]

    def bind(self, handle: Any, device: torch.device) -> None:
        if not isinstance(handle, StandinHandle) or handle.device != device:
            raise StandinError(f"a stream bound to {handle!r}, not this device's handle")
        handle.binds += 1


class _Module:
    """The real ``cudnn`` module, its ``pygraph`` returning stand-in graphs."""

    def __init__(self, real: Any, owner: StandinFrontend) -> None:
        self._real, self._owner = real, owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def pygraph(self, **kwargs: Any) -> _Graph:
        handle = kwargs.pop("handle", None)
        if handle is not None and not isinstance(handle, StandinHandle):
            raise StandinError(f"pygraph given a handle that is not the stand-in's: {handle!r}")
        return _Graph(self._real.pygraph(handle=None, **kwargs), self._owner, self._real)


@dataclass
class _Graph:
    """A real frontend graph description, built and executed by the stand-in."""

    described: Any
    owner: StandinFrontend
    module: Any
    steps: list[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:  # tensor, sdpa, sdpa_backward, nodes: described
        return getattr(self.described, name)

    @property
    def node(self) -> Any:
        nodes = list(self.described.nodes)
        if len(nodes) != 1:
            raise StandinError(f"the stand-in runs one sdpa node, the graph has {len(nodes)}")
        return nodes[0]

    @property
    def kind(self) -> str:
        return "backward" if "dO" in self.node.inputs else "forward"

    def validate(self) -> None:
        node, params = self.node, self.node.params
        if not params.get("use_padding_mask"):
            raise StandinError("ragged tensors need the padding mask (cuDNN refuses them without)")
        for name in ("seq_len_q", "seq_len_kv"):
            t = node.inputs.get(name)
            if t is None:
                raise StandinError(f"the padding mask needs {name}")
            if _kind(t) != "INT32" or list(t.dim)[1:] != [1, 1, 1]:
                raise StandinError(f"{name} must be int32 [B, 1, 1, 1], is {_kind(t)} {t.dim}")
        dim = node.inputs["q"].dim
        if dim[3] % 8 or dim[3] > 256:
            raise StandinError(f"head dim {dim[3]}: cuDNN takes multiples of 8 up to 256")
        self.steps.append("validate")

    def build_operation_graph(self) -> None:
        if "validate" not in self.steps:
            raise StandinError("build_operation_graph before validate")
        self.steps.append("build_operation_graph")

    def create_execution_plans(self, modes: Any) -> None:
        self.steps.append("create_execution_plans")

    def check_support(self) -> None:
        refusal = self.owner.refuse.get(self.kind)
        if refusal is not None:
            raise refusal
        self.steps.append("check_support")

    def build_plans(self) -> None:
        if self.steps[-1:] != ["check_support"]:
            raise StandinError(f"build_plans after {self.steps}")
        self.steps.append("build_plans")
        self.owner.built.append(self.kind)

    def get_workspace_size(self) -> int:
        """Backward: its float32 dQ accumulator (module docstring); forward: none."""
        if self.kind == "forward":
            return 0
        return 4 * _accumulator_elements(self.node)

    def execute(self, pack: dict[int, torch.Tensor], workspace: torch.Tensor, handle: Any) -> None:
        if "build_plans" not in self.steps:
            raise StandinError("execute before build_plans")
        if not isinstance(handle, StandinHandle) or handle.binds == 0:
            raise StandinError("execute on a handle no stream was bound to")
        node = self.node
        wanted = _uids(node)
        missing, foreign = sorted(set(wanted) - set(pack)), sorted(set(pack) - set(wanted))
        if missing or foreign:
            raise StandinError(f"variant pack: missing uids {missing}, not in the graph {foreign}")
        memory = _Memory(pack, wanted)
        if self.kind == "forward":
            _forward(node, memory)
        else:
            _backward(node, memory, workspace)
        self.owner.executed.append(self.kind)


def _kind(t: Any) -> str:
    for name in _DTYPES:
        if t.data_type == getattr(_real_data_type(), name):
            return name
    raise StandinError(f"uid {t.uid}: data type {t.data_type} not handled by the stand-in")


def _real_data_type() -> Any:
    import cudnn

    return cudnn.data_type


def _uids(node: Any) -> dict[int, Any]:
    """Every non-virtual tensor of the node by uid, ragged offsets included."""
    out: dict[int, Any] = {}
    for t in (*node.inputs.values(), *node.outputs.values()):
        if t is None or t.is_virtual:
            continue
        out[t.uid] = t
        if t.ragged_offset is not None:
            out[t.ragged_offset.uid] = t.ragged_offset
    return out


class _Memory:
    """The variant pack's buffers seen through their pointers, in the graph's dtypes."""

    def __init__(self, pack: dict[int, torch.Tensor], tensors: dict[int, Any]) -> None:
        self.pack, self.tensors = pack, tensors

    def flat(self, uid: int) -> torch.Tensor:
        """The memory from the pointer of ``uid``'s buffer to the end of its storage, as the
        graph's dtype for it."""
        data, dtype = self.pack[uid], _TORCH[_kind(self.tensors[uid])]
        storage = data.untyped_storage()
        start = data.storage_offset() * data.element_size()
        size = torch.empty(0, dtype=dtype).element_size()
        if start % size:
            raise StandinError(f"uid {uid}: a pointer not aligned to its {dtype}")
        count = (storage.nbytes() - start) // size
        return torch.empty(0, dtype=dtype).set_(storage, start // size, (count,), (1,))

    def ints(self, uid: int, count: int) -> torch.Tensor:
        flat = self.flat(uid)
        if flat.numel() < count:
            raise StandinError(
                f"uid {uid}: cuDNN reads {count} values, the buffer holds {flat.numel()}: it "
                "would read past its end"
            )
        return flat[:count].to(torch.int64)

    def starts(self, t: Any, batch: int) -> list[int]:
        """Each document's first token in the ragged tensor ``t``."""
        offsets = self.ints(t.ragged_offset.uid, batch + 1).tolist()
        unit, token = int(t.ragged_offset_multiplier or 1), int(t.stride[2])
        out = []
        for b, offset in enumerate(offsets[:batch]):
            elements = offset * unit
            if elements % token:
                raise StandinError(
                    f"uid {t.uid}: ragged offset {offset} of document {b} is not a whole token "
                    f"({token} elements a token)"
                )
            out.append(elements // token)
        return out

    def index(self, t: Any, start: int, rows: int) -> torch.Tensor:
        """Element indices [rows, heads, dim] of rows start.. of a ragged tensor (token units)."""
        st = [int(x) for x in t.stride]
        s = torch.arange(rows)[:, None, None]
        h = torch.arange(int(t.dim[1]))[None, :, None]
        d = torch.arange(int(t.dim[3]))[None, None, :]
        return (start + s) * st[2] + h * st[1] + d * st[3]

    def read(self, t: Any, start: int, rows: int) -> torch.Tensor:
        """[heads, rows, dim] float64."""
        flat, idx = self.flat(t.uid), self.index(t, start, rows)
        _inside(t.uid, idx, flat.numel())
        return flat[idx].to(torch.float64).transpose(0, 1)

    def write(self, t: Any, start: int, values: torch.Tensor) -> None:
        """``values`` [heads, rows, dim] into rows start.. of a ragged output."""
        flat, idx = self.flat(t.uid), self.index(t, start, values.shape[1])
        _inside(t.uid, idx, flat.numel())
        flat[idx] = values.transpose(0, 1).to(flat.dtype)


def _inside(uid: int, idx: torch.Tensor, size: int) -> None:
    if idx.numel() and (int(idx.max()) >= size or int(idx.min()) < 0):
        raise StandinError(
            f"uid {uid}: cuDNN would touch element {int(idx.max())} of a buffer of {size}"
        )


def _lengths(node: Any, memory: _Memory, batch: int) -> tuple[list[int], list[int]]:
    lq = memory.ints(node.inputs["seq_len_q"].uid, batch).tolist()
    lk = memory.ints(node.inputs["seq_len_kv"].uid, batch).tolist()
    seqlen = int(node.inputs["q"].dim[2])
    for name, lengths in (("seq_len_q", lq), ("seq_len_kv", lk)):
        if any(n < 0 or n > seqlen for n in lengths):
            raise StandinError(f"{name} {lengths} outside 0..S={seqlen}")
    return lq, lk


def _allowed(node: Any, nq: int, nk: int) -> torch.Tensor:
    import cudnn

    params = node.params
    right = params.get("diagonal_band_right_bound")
    if params.get("diagonal_band_left_bound") is not None:
        raise StandinError("the stand-in has no left bound")
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    if right is None:
        return torch.ones(nq, nk, dtype=torch.bool)
    shift = 0 if params["diagonal_alignment"] == cudnn.diagonal_alignment.TOP_LEFT else nk - nq
    return j - i <= int(right) + shift


def _scores(node: Any, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaled scores [H, nq, nk] with -inf where masked, the allowed mask)."""
    allowed = _allowed(node, q.shape[1], k.shape[1])
    scores = float(node.params["attn_scale"]) * q @ k.transpose(1, 2)
    return scores.masked_fill(~allowed, -math.inf), allowed


def _grouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[G, n, d] -> [H, n, d]: query head h reads group h // (H / G)."""
    if heads % x.shape[0]:
        raise StandinError(f"{heads} query heads over {x.shape[0]} key/value heads")
    return x.repeat_interleave(heads // x.shape[0], dim=0)


def _stats_index(t: Any, b: int, rows: int) -> torch.Tensor:
    st = [int(x) for x in t.stride]
    h = torch.arange(int(t.dim[1]))[:, None]
    s = torch.arange(rows)[None, :]
    return b * st[0] + h * st[1] + s * st[2]


def _forward(node: Any, memory: _Memory) -> None:
    q_t, k_t, v_t = node.inputs["q"], node.inputs["k"], node.inputs["v"]
    o_t, stats_t = node.outputs["O"], node.outputs["Stats"]
    batch, heads = int(q_t.dim[0]), int(q_t.dim[1])
    lq, lk = _lengths(node, memory, batch)
    starts = {
        n: memory.starts(t, batch) for n, t in (("q", q_t), ("k", k_t), ("v", v_t), ("o", o_t))
    }
    stats = memory.flat(stats_t.uid)
    for b in range(batch):
        if lq[b] == 0:
            continue
        q = memory.read(q_t, starts["q"][b], lq[b])
        k = _grouped(memory.read(k_t, starts["k"][b], lk[b]), heads)
        v = _grouped(memory.read(v_t, starts["v"][b], lk[b]), heads)
        scores, _ = _scores(node, q, k)
        lse = torch.logsumexp(scores, dim=-1)
        memory.write(o_t, starts["o"][b], torch.softmax(scores, dim=-1) @ v)
        idx = _stats_index(stats_t, b, lq[b])
        _inside(stats_t.uid, idx, stats.numel())
        stats[idx] = lse.to(stats.dtype)


def _accumulator_elements(node: Any) -> int:
    """The frontend's dQ accumulator: THD (dQ's ragged layout, max_total_seq_len_q rows) when dQ
    is ragged and max_total_seq_len_q is set, else BHSD."""
    dq, total = node.outputs["dQ"], node.params.get("max_total_seq_len_q")
    if dq.ragged_offset is not None and total is not None:
        return int(total) * int(dq.stride[2])
    b, h, s, d = (int(x) for x in dq.dim)
    return b * h * s * d


def _backward(node: Any, memory: _Memory, workspace: torch.Tensor) -> None:
    ins = node.inputs
    q_t, k_t, v_t, o_t, do_t, stats_t = (ins[n] for n in ("q", "k", "v", "o", "dO", "stats"))
    dq_t, dk_t, dv_t = (node.outputs[n] for n in ("dQ", "dK", "dV"))
    batch, heads = int(q_t.dim[0]), int(q_t.dim[1])
    groups = int(k_t.dim[1])
    lq, lk = _lengths(node, memory, batch)
    tensors = {
        "q": q_t,
        "k": k_t,
        "v": v_t,
        "o": o_t,
        "dO": do_t,
        "dQ": dq_t,
        "dK": dk_t,
        "dV": dv_t,
    }
    starts = {n: memory.starts(t, batch) for n, t in tensors.items()}
    stats = memory.flat(stats_t.uid)
    need = _accumulator_elements(node)
    accumulator = _workspace_floats(workspace, need)
    thd = dq_t.ragged_offset is not None and node.params.get("max_total_seq_len_q") is not None
    for b in range(batch):
        if lq[b] == 0:
            continue
        q = memory.read(q_t, starts["q"][b], lq[b])
        k = _grouped(memory.read(k_t, starts["k"][b], lk[b]), heads)
        v = _grouped(memory.read(v_t, starts["v"][b], lk[b]), heads)
        o = memory.read(o_t, starts["o"][b], lq[b])
        d_o = memory.read(do_t, starts["dO"][b], lq[b])
        idx = _stats_index(stats_t, b, lq[b])
        _inside(stats_t.uid, idx, stats.numel())
        lse = stats[idx].to(torch.float64)
        scores, allowed = _scores(node, q, k)
        p = torch.exp(scores - lse[..., None]) * allowed
        scale = float(node.params["attn_scale"])
        d_v = p.transpose(1, 2) @ d_o
        d_p = d_o @ v.transpose(1, 2)
        d_s = p * (d_p - (d_o * o).sum(-1, keepdim=True))
        d_q = scale * d_s @ k
        d_k = scale * d_s.transpose(1, 2) @ q
        per = heads // groups
        d_k = d_k.view(groups, per, *d_k.shape[1:]).sum(1)
        d_v = d_v.view(groups, per, *d_v.shape[1:]).sum(1)
        if thd:
            acc = memory.index(dq_t, starts["dQ"][b], lq[b])
        else:
            st = (
                int(dq_t.dim[1]) * int(dq_t.dim[2]) * int(dq_t.dim[3]),
                int(dq_t.dim[2]) * int(dq_t.dim[3]),
                int(dq_t.dim[3]),
            )
            s = torch.arange(lq[b])[:, None, None]
            h = torch.arange(heads)[None, :, None]
            d = torch.arange(int(dq_t.dim[3]))[None, None, :]
            acc = b * st[0] + h * st[1] + s * st[2] + d
        if int(acc.max()) >= need:
            raise StandinError(
                f"dQ accumulator of {need} floats (max_total_seq_len_q="
                f"{node.params.get('max_total_seq_len_q')}) is too small for document {b}"
            )
        accumulator[acc] = d_q.transpose(0, 1).to(torch.float32)
        memory.write(dq_t, starts["dQ"][b], accumulator[acc].to(torch.float64).transpose(0, 1))
        memory.write(dk_t, starts["dK"][b], d_k)
        memory.write(dv_t, starts["dV"][b], d_v)


def _workspace_floats(workspace: torch.Tensor, need: int) -> torch.Tensor:
    if workspace.dtype != torch.uint8 or workspace.numel() < 4 * need:
        raise StandinError(
            f"workspace of {workspace.numel()} {workspace.dtype} given, the graph needs {4 * need} bytes"
        )
    storage = workspace.untyped_storage()
    start = workspace.storage_offset()
    if start % 4:
        raise StandinError("workspace not aligned to float32")
    return torch.empty(0, dtype=torch.float32).set_(storage, start // 4, (need,), (1,))
