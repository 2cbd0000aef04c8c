"""`Documents`: the boundaries of one THD micro-batch, and everything derived from them, once.

megatron-core hands every layer the same ``packed_seq_params``; `Documents.from_params` caches one
`Documents` on it (keyed by the identity and version of the boundary tensors, as
`megapack.attention.cp_attention.plan_for` caches the CP plan), so what the kernels derive from the boundaries
is computed by the first layer and reused by every other layer and by the backward pass:

    segment_ids / offsets / real   [T] on the device, no host read (searchsorted over the boundaries)
    host_bounds                    the boundaries as Python lists: the one host read of the SDPA
                                   reference, once per micro-batch
    memo                           per-kernel values (the flex block mask, RoPE cos/sin tables)

Worked example: documents of real lengths ``[3, 2]`` padded to ``[4, 4]``: ``cu_real [0, 3, 5]``,
``cu_buffer [0, 4, 8]``; ``segment_ids [0, 0, 0, 0, 1, 1, 1, 1]``, ``offsets [0, 1, 2, 3, 0, 1, 2, 3]``
(RoPE's positions), ``real [T, T, T, F, T, T, F, F]``.

Without padding (``cu_buffer is cu_real``) the boundaries must end at T: a tail past the last
document is not detected (that would need a host read).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

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
        self._key = _key(cu_real, cu_buffer, max_seqlen, total)

    @classmethod
    def from_params(cls, params: Any, total: int) -> Documents:
        """The `Documents` of ``params`` (megatron-core ``PackedSeqParams``), cached on it."""
        cu_real = params.cu_seqlens_q
        cu_buffer = cu_real if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        max_seqlen = params.max_seqlen_q
        cached = getattr(params, _CACHE, None)
        if cached is not None and cached._key == _key(cu_real, cu_buffer, max_seqlen, total):
            return cached
        kv = params.cu_seqlens_kv
        # Identity first: megapack passes one tensor for q and kv, so no device sync happens here.
        if kv is not None and kv is not cu_real and not torch.equal(kv, cu_real):
            raise ValueError(
                "PackedAttention is self-attention: cu_seqlens_kv must equal cu_seqlens_q"
            )
        docs = cls(cu_real, cu_buffer, int(max_seqlen), total)
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
        if cached is not None and cached._key == _key(cu_real, holder, max_seqlen, total):
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

    def real(self) -> torch.Tensor | None:
        """[T] bool, False on alignment padding; None when nothing is padded."""
        if not self.padded:
            return None
        if "real" not in self.memo:
            lengths = (self.cu_real[1:] - self.cu_real[:-1]).to(torch.int64)
            self.memo["real"] = self.offsets() < lengths[self.segment_ids()]
        return self.memo["real"]

    def host_bounds(self) -> tuple[list[int], list[int]]:
        """(buffer boundaries, real boundaries) as Python lists: one host read per micro-batch."""
        if "host_bounds" not in self.memo:
            if self.padded:
                both = torch.stack([self.cu_buffer.to(torch.int64), self.cu_real.to(torch.int64)])
                buffer, real = both.tolist()
            else:
                buffer = real = self.cu_buffer.tolist()
            self.memo["host_bounds"] = (buffer, real)
        return self.memo["host_bounds"]


def zero_padding(out: torch.Tensor, docs: Documents) -> torch.Tensor:
    """``out [T, h, d]`` with alignment-padding positions set to zero."""
    real = docs.real()
    return out if real is None else out * real[:, None, None].to(out.dtype)


def _key(cu_real: torch.Tensor, cu_buffer: torch.Tensor, max_seqlen: Any, total: int) -> tuple:
    """What a cached `Documents` must match: the same tensors, unmodified, and the same sizes.

    Identities, not values: comparing values would read the device. The cached `Documents` holds
    the tensors, so their ids cannot be reused while it lives.
    """
    longest = max_seqlen if isinstance(max_seqlen, int) else id(max_seqlen)
    return (id(cu_real), cu_real._version, id(cu_buffer), cu_buffer._version, longest, total)
