"""`Documents`: the boundaries of one THD micro-batch, and everything derived from them, once.

megatron-core hands every layer the same ``packed_seq_params``; `Documents.from_params` caches one
`Documents` on it (keyed by the identity and version of the boundary tensors and by the CUDA-graph
capture under way), so what the kernels derive from the boundaries is computed by the first layer
and reused by every other layer and by the backward pass:

    segment_ids / offsets / kept   [T] on the device, no host read (searchsorted over the boundaries)
    host_bounds                    the boundaries as Python lists: the one host read of the SDPA
                                   reference, once per micro-batch (refused inside a capture)
    memo                           per-kernel values: the flex block mask, RoPE cos/sin tables, the
                                   context-parallel plan (`megapack.attention.cp_plan.plan_for`), the
                                   cuDNN and bucketed kernels' offsets and plans

This is the one owner of per-micro-batch derived state, so the rule for CUDA graphs lives here
(`megapack.core.capture`): an entry is valid only under the capture token it was built under.
A warm-up's `Documents` is not reused inside a capture (its tensors would be frozen into every
replay: the first batch's boundaries forever); the capture builds its own, recorded in the graph,
which its layers share; the first eager call after the capture builds a fresh one. Refilling the
boundary tensors in place (`megapack.GraphInputs.load`) bumps their version: the next call rebuilds.

Worked example: documents of real lengths ``[3, 2]`` padded to ``[4, 4]``: ``cu_real [0, 3, 5]``,
``cu_buffer [0, 4, 8]``; ``segment_ids [0, 0, 0, 0, 1, 1, 1, 1]``, ``offsets [0, 1, 2, 3, 0, 1, 2, 3]``
(RoPE's positions), ``kept [T, T, T, F, T, T, F, F]``.

Positions past the last boundary (``cu_buffer[-1] < T``, e.g. a row whose trailing padding is in
no segment) hold no token: `kept` is False there as on alignment padding, and every backend gives
them zeros, output and gradients, whatever they hold (`zero_outside`, `guard_outside`; cuDNN's
outputs are zero-filled, bucketed and sdpa never read them). Finding such a tail is not needed:
the masks are computed on the device, so nothing reads the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from typing import Any

import torch

from megapack.core.capture import capture_token, refuse_under_capture
from megapack.core.seq_params import BUCKETS_ATTR

_CACHE = "_megapack_documents"


class Documents:
    """Document boundaries of a THD buffer: real lengths and buffer offsets (equal without padding).

    Args:
        cu_real: int [n + 1] real boundaries (``cu_seqlens``).
        cu_buffer: int [n + 1] buffer boundaries (``cu_seqlens_padded``); ``cu_real`` itself when
            nothing is padded.
        max_seqlen: longest buffer segment (Python int).
        total: T, the number of buffer positions (this rank's share under context parallelism).
    """

    def __init__(
        self, cu_real: torch.Tensor, cu_buffer: torch.Tensor, max_seqlen: int, total: int
    ) -> None:
        self.cu_real = cu_real
        self.cu_buffer = cu_buffer
        self.max_seqlen = max_seqlen
        self.total = total
        self.padded = cu_buffer is not cu_real
        self.memo: dict[Any, Any] = {}
        """Values kernels derive from these boundaries (flex block mask, RoPE tables), by key."""
        self.token = capture_token()
        """The CUDA-graph capture this was built under (None: eager); see the module docstring."""
        self.buckets: tuple[torch.Tensor, ...] | None = None
        """The delivered bucket plan (`megapack.core.buckets`), when the batch brought one."""
        self._key = _key(cu_real, cu_buffer, max_seqlen, total, self.token)

    @classmethod
    def from_params(cls, params: Any, total: int) -> Documents:
        """The `Documents` of ``params`` (megatron-core ``PackedSeqParams``), cached on it."""
        cu_real = params.cu_seqlens_q
        cu_buffer = cu_real if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        max_seqlen = params.max_seqlen_q
        cached = getattr(params, _CACHE, None)
        if cached is not None and cached._key == _key(
            cu_real, cu_buffer, max_seqlen, total, capture_token()
        ):
            return cached
        kv = params.cu_seqlens_kv
        # Identity first: megapack passes one tensor for q and kv, so no device sync happens here.
        if kv is not None and kv is not cu_real and not torch.equal(kv, cu_real):
            raise ValueError(
                "PackedAttention is self-attention: cu_seqlens_kv must equal cu_seqlens_q"
            )
        docs = cls(cu_real, cu_buffer, int(max_seqlen), total)
        docs.buckets = getattr(params, BUCKETS_ATTR, None)
        with contextlib.suppress(AttributeError):  # a params object without __dict__: no cache
            setattr(params, _CACHE, docs)
        return docs

    @classmethod
    def cached(
        cls, cu_real: torch.Tensor, cu_buffer: torch.Tensor | None, max_seqlen: int, total: int
    ) -> Documents:
        """The `Documents` of these boundaries, cached on the buffer-boundary tensor itself.

        For callers without ``packed_seq_params`` (`megapack.attention.packed_attention`): calls with
        the same boundary tensors (same objects, not modified in place) share one block mask.
        """
        holder = cu_real if cu_buffer is None else cu_buffer
        cached = getattr(holder, _CACHE, None)
        if cached is not None and cached._key == _key(
            cu_real, holder, max_seqlen, total, capture_token()
        ):
            return cached
        docs = cls(cu_real, holder, max_seqlen, total)
        setattr(holder, _CACHE, docs)
        return docs

    def segment_ids(self) -> torch.Tensor:
        """[T] int64 index of the buffer segment of every position (on device, no host read)."""
        if "segment_ids" not in self.memo:
            positions = torch.arange(self.total, device=self.cu_buffer.device)
            cu = self.cu_buffer[1:].to(torch.int64)
            seg = torch.searchsorted(cu, positions, right=True)
            self.memo["segment_ids"] = seg.clamp(max=len(self.cu_buffer) - 2)
        return self.memo["segment_ids"]

    def offsets(self) -> torch.Tensor:
        """[T] int64 position of every buffer position within its segment (RoPE's position)."""
        if "offsets" not in self.memo:
            positions = torch.arange(self.total, device=self.cu_buffer.device)
            starts = self.cu_buffer.to(torch.int64)[self.segment_ids()]
            self.memo["offsets"] = positions - starts
        return self.memo["offsets"]

    def kept(self) -> torch.Tensor:
        """[T] bool: True where a position holds a document's real token; False on alignment
        padding and past the last boundary (on the device, no host read).

        Example:
            >>> Documents(torch.tensor([0, 2, 3]), torch.tensor([0, 2, 3]), 2, 5).kept().tolist()
            [True, True, True, False, False]
        """
        if "kept" not in self.memo:
            lengths = (self.cu_real[1:] - self.cu_real[:-1]).to(torch.int64)
            # a position past the last boundary falls in the last segment (segment_ids clamps),
            # at an offset >= that segment's length: not kept
            self.memo["kept"] = self.offsets() < lengths[self.segment_ids()]
        return self.memo["kept"]

    def host_bounds(self) -> tuple[list[int], list[int]]:
        """(buffer boundaries, real boundaries) as Python lists: one host read per micro-batch.

        Raises:
            CaptureError: inside a CUDA-graph capture (a host read cannot be recorded).
        """
        if "host_bounds" not in self.memo:
            refuse_under_capture(
                "the document boundaries' host copy (attention backend 'sdpa', or 'bucketed' "
                "without a delivered plan)",
                "a host read cannot be recorded",
                "capture with backend 'cudnn', 'te', 'flash_attn' or 'torch_varlen' and a "
                "megapack.StaticShape",
            )
            if self.padded:
                both = torch.stack([self.cu_buffer.to(torch.int64), self.cu_real.to(torch.int64)])
                buffer, real = both.tolist()
            else:
                buffer = real = self.cu_buffer.tolist()
            self.memo["host_bounds"] = (buffer, real)
        return self.memo["host_bounds"]


def zero_outside(out: torch.Tensor, docs: Documents) -> torch.Tensor:
    """``out [T, h, d]`` with every position that holds no real token (alignment padding, past
    the last boundary) set to exactly zero, whatever the kernel left there (``torch.where``, not a
    product: uninitialised memory may hold NaN). Its gradient is zero there too.

    Cost: one pass over ``out`` forward and one over its gradient backward.
    """
    return torch.where(docs.kept()[:, None, None], out, out.new_zeros(()))


def guard_outside(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v unchanged, whose gradients are set to exactly zero where `Documents.kept` is False.

    For kernels that leave their input gradients uninitialised outside the boundaries they were
    given (FlashAttention-based ones allocate them with ``empty_like`` and write only within
    ``cu_seqlens``): without this, whatever memory held past the last boundary would flow into
    the QKV weight gradients. Cost: backward only, one pass over each of dq, dk and dv.
    """
    out = _ZeroGradOutside.apply(q, k, v, docs.kept())
    return out[0], out[1], out[2]


class _ZeroGradOutside(torch.autograd.Function):
    """Identity forward; backward: each gradient zeroed where ``kept`` is False."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(kept)
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        (kept,) = ctx.saved_tensors
        mask = kept[:, None, None]
        zeroed = tuple(None if g is None else torch.where(mask, g, g.new_zeros(())) for g in grads)
        return (*zeroed, None)


def _key(
    cu_real: torch.Tensor, cu_buffer: torch.Tensor, max_seqlen: Any, total: int, token: Hashable
) -> tuple:
    """What a cached `Documents` must match: the same tensors, unmodified, the same sizes, and
    the same CUDA-graph capture (`megapack.core.capture.capture_token`; None: eager).

    Identities, not values: comparing values would read the device. The cached `Documents` holds
    the tensors, so their ids cannot be reused while it lives.
    """
    longest = max_seqlen if isinstance(max_seqlen, int) else id(max_seqlen)
    return (id(cu_real), cu_real._version, id(cu_buffer), cu_buffer._version, longest, total, token)
