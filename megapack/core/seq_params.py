"""megatron-core's ``PackedSeqParams`` for a packed batch, whatever release is installed.

Every transfer call builds one, so the class is looked up once per process (importing megatron
takes ~5 s, hence lazily) and its field names are read once per class. Only what the installed
release defines is filled; `make_packed_seq_params` says which value it cannot place.

Example: cu_seqlens ``[0, 3, 5, 9]`` (documents of 3, 2 and 4 tokens), max_seqlen 4 ->
``PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, ...)``.

A delivered bucket plan (`megapack.core.buckets`) rides on the object as ``BUCKETS_ATTR``, where
megatron-core passes it untouched to every layer's core attention.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

BUCKETS_ATTR = "megapack_buckets"
"""The attribute of a ``PackedSeqParams`` that holds a delivered bucket plan (a tuple of [n, L])."""


def make_packed_seq_params(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    max_seqlen: int,
    *,
    cp_group: Any = None,
    local_cp_size: int | None = None,
    buckets: tuple[torch.Tensor, ...] | None = None,
) -> PackedSeqParams:
    """megatron-core ``PackedSeqParams`` in THD format with Python-int maxima.

    Fills every field the installed megatron-core defines, probing its dataclass so older and newer
    releases both work: q and kv boundaries (real and padded), ``max_seqlen_q/kv``, and, where the
    release has them, ``cp_group`` (context-parallel group; None without CP) and ``local_cp_size``
    (Megatron's hybrid CP). A release without ``cp_group`` reads it from the model config instead,
    so it is left out; any other value the release has no field for is a ValueError naming it.
    ``buckets``, a delivered bucket plan, is set as the attribute ``BUCKETS_ATTR``.
    """
    params_class, known = _packed_seq_params_class()
    values: dict[str, Any] = {
        "qkv_format": "thd",
        "cu_seqlens_q": cu_seqlens,
        "cu_seqlens_kv": cu_seqlens,
        "cu_seqlens_q_padded": cu_seqlens_padded,
        "cu_seqlens_kv_padded": cu_seqlens_padded,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen,
        "cp_group": cp_group,
        "local_cp_size": local_cp_size,
    }
    if values.keys() <= known:  # megatron-core >= 0.14 has them all: nothing to probe
        params = params_class(**values)
    else:
        missing = [
            k for k, v in values.items() if k not in known and v is not None and k != "cp_group"
        ]
        if missing:
            raise ValueError(
                f"this megatron-core's PackedSeqParams has no field {missing[0]!r} (given "
                f"{values[missing[0]]!r}); upgrade megatron-core (local_cp_size needs hybrid CP "
                "support)"
            )
        params = params_class(**{k: v for k, v in values.items() if k in known})
    if buckets is not None:
        setattr(params, BUCKETS_ATTR, buckets)
    return params


def _packed_seq_params_class() -> tuple[type[PackedSeqParams], frozenset[str]]:
    """megatron-core's PackedSeqParams and its field names (this runs on every transfer call).

    Imported lazily (importing megatron takes ~5 s), with its warnings quieted only that first
    time: entering `quiet_megatron` costs more than the rest of a call.
    """
    module: Any = sys.modules.get("megatron.core.packed_seq_params")
    if module is None:
        from megapack.core.quiet import quiet_megatron

        with quiet_megatron():
            import megatron.core.packed_seq_params

        module = megatron.core.packed_seq_params
    return module.PackedSeqParams, _fields_of(module.PackedSeqParams)


@functools.cache
def _fields_of(cls: type) -> frozenset[str]:
    """A dataclass's field names (read once per class)."""
    return frozenset(f.name for f in dataclasses.fields(cls))
