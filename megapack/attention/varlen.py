"""torch's ``varlen_attn`` in each of its released forms, found from its signature, never a version.

``torch.nn.attention.varlen.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, ...)``
(FlashAttention 2 underneath: CUDA, float16/bfloat16 only) has changed its keyword arguments:

    torch 2.10   is_causal=False, return_aux=None             no scale, no GQA
    torch 2.11   *, return_aux=None, scale=None, window_size=(-1, -1)   causal is window (-1, 0)
    torch 2.12+  ... window_size=(-1, -1), enable_gqa=False, seqused_k, block_table, num_splits

`VarlenForm.of` reads which of ``is_causal``, ``window_size``, ``scale`` and ``enable_gqa`` the
installed function takes, and `call_varlen` calls it with those only:

* causal: ``window_size=(-1, 0)`` where it exists, else ``is_causal=True``;
* scale: passed where it exists, else folded into q (``q * scale * sqrt(d)``; the kernel's own
  scale is 1 / sqrt(d));
* grouped-query attention (g key/value heads < h query heads): ``enable_gqa=True`` where it exists,
  else K and V repeated to h heads by `repeat_kv`.

`repeat_kv` is ``expand`` + ``reshape``: one copy of K and V (forward), a sum over the repeats
(backward). Measured on this 2-core CPU (torch 2.13, K [T, 4, 128] to 16 heads, forward + backward,
median of 10): T=4,096: 46 / 36 / 151 ms (fp32) and 24 / 24 / 136 ms (bf16) for expand+reshape /
``repeat_interleave`` / ``index_select``; T=14,398: 80 / 83 / 188 ms (fp32), 51 / 51 / 156 ms (bf16).
``repeat_interleave`` with an int count is the same view + clone in autograd (its graph shows it), so
the two are one kernel and differ only by noise; ``index_select`` is 2-4x slower. On a GPU: unmeasured.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class VarlenForm:
    """The keyword arguments an installed ``varlen_attn`` takes."""

    causal: str
    """"window_size" (torch >= 2.11: causal is ``window_size=(-1, 0)``) or "is_causal" (2.10)."""
    scale: bool
    """It takes ``scale=`` (torch >= 2.11); else the scale is folded into q."""
    enable_gqa: bool
    """It takes ``enable_gqa=`` (torch >= 2.12); else K/V heads are repeated (`repeat_kv`)."""

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> VarlenForm | None:
        """The form of ``fn``, or None when it can express neither causal argument.

        Example:
            >>> def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
            ...                 return_aux=None, scale=None, window_size=(-1, -1)): ...
            >>> VarlenForm.of(varlen_2_11)
            VarlenForm(causal='window_size', scale=True, enable_gqa=False)
        """
        try:
            names = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return None
        if "window_size" in names:
            causal = "window_size"
        elif "is_causal" in names:
            causal = "is_causal"
        else:
            return None
        return cls(causal=causal, scale="scale" in names, enable_gqa="enable_gqa" in names)

    def describe(self) -> str:
        """What megapack does around this form, for the backend-choice log line."""
        notes = [] if self.enable_gqa else ["varlen_attn without enable_gqa: K/V heads repeated"]
        if not self.scale:
            notes.append("no scale argument: scale folded into q")
        if self.causal == "is_causal":
            notes.append("causal via is_causal")
        return "; ".join(notes)


def installed_varlen() -> Callable[..., Any] | None:
    """torch's ``varlen_attn``, looked up at call time (so a test's stand-in is seen), or None."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


@functools.lru_cache(maxsize=8)
def form_of(fn: Callable[..., Any]) -> VarlenForm | None:
    """`VarlenForm.of`, once per function object."""
    return VarlenForm.of(fn)


def repeat_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """``x [T, g, d]`` -> ``[T, g * repeats, d]``, head ``i`` from group ``i // repeats``.

    Example:
        >>> repeat_kv(torch.tensor([[[1.0], [2.0]]]), 2)[0, :, 0].tolist()
        [1.0, 1.0, 2.0, 2.0]
    """
    if repeats == 1:
        return x
    total, groups, dim = x.shape
    return (
        x[:, :, None, :].expand(total, groups, repeats, dim).reshape(total, groups * repeats, dim)
    )


def call_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float,
) -> torch.Tensor:
    """Causal ``varlen_attn`` (bottom-right aligned when keys outnumber queries) in its installed form.

    ``q [Tq, h, d]``, ``k``/``v [Tk, g, d]`` (g divides h), int32 ``cu_q``/``cu_k``; returns [Tq, h, d].
    """
    fn = installed_varlen()
    form = None if fn is None else form_of(fn)
    if fn is None or form is None:
        raise ValueError(
            "torch.nn.attention.varlen.varlen_attn is missing or takes neither window_size nor "
            "is_causal; use backend='auto'"
        )
    kwargs: dict[str, Any] = {}
    if form.causal == "window_size":
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if form.scale:
        kwargs["scale"] = scale
    elif not math.isclose(scale, 1.0 / math.sqrt(q.shape[-1]), rel_tol=1e-12):
        q = q * (scale * math.sqrt(q.shape[-1]))
    if q.shape[1] != k.shape[1]:
        if form.enable_gqa:
            kwargs["enable_gqa"] = True
        else:
            repeats = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, repeats), repeat_kv(v, repeats)
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    return cast(torch.Tensor, out)
