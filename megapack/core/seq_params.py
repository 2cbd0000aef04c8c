"""megatron-core's ``PackedSeqParams`` for a packed batch, whatever release is installed.

Every transfer call builds one. Only the fields the installed release offers are filled
(`megapack.core.megatron_release`, probed once per process); `make_packed_seq_params` says which
value it cannot place.

Example: cu_seqlens ``[0, 3, 5, 9]`` (documents of 3, 2 and 4 tokens), max_seqlen 4 ->
``PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, ...,
pad_between_seqs=False)``; with the documents padded to multiples of 4, cu_seqlens_padded
``[0, 4, 8, 12]`` -> the same with ``cu_seqlens_q_padded=cu_seqlens_kv_padded=[0, 4, 8, 12]`` and
``pad_between_seqs=True``.

The fields megatron-core 0.19 added, and what is set from a packed batch:

    pad_between_seqs   True exactly when padded boundaries (``cu_seqlens_padded``) are given, else
                       False. Transformer Engine (>= 2.2, through megatron-core's
                       TEDotProductAttention) otherwise infers it with ``torch.equal`` on the
                       padded and real boundaries: a host sync on every layer's call, and an error
                       under CUDA-graph capture. Whether padded boundaries are given is known on
                       the host (a delivered frame's header says whether it carries them), so the
                       flag costs nothing. Padded boundaries equal to the real ones (documents that
                       needed no alignment) still give True: TE then reads the padded offsets,
                       which are the real ones, so attention is the same; only the flash-attn
                       backend (no padding between sequences) is no longer eligible.
    total_tokens       not set. Its only use is ``PackedSeqParams.__post_init__`` building
    seq_idx              ``seq_idx`` (the document of every token) for Mamba layers; that is a
                       ``repeat_interleave`` without an output size (a host sync on CUDA) on every
                       call, for GPT layers that never read it, and `GraphInputs`' params, made
                       once, would keep the first batch's. A Mamba trainer sets it itself.
    tokens_per_sample  not set. MoE layers read it to cut ``[mbs * S]`` back into samples for the
                       sequence-level auxiliary loss, which holds only when each layer sees whole
                       rows (no context or sequence parallelism); a delivered micro-batch is one
                       THD row whose row length the frame does not carry. Unset, MoE weighs the
                       micro-batch as one sample, as megatron-core 0.16 did.
    cp_group           the context-parallel group when given; a release without the field reads
                       it from the model config, so it is left out there.
    local_cp_size      Megatron's hybrid CP; a ValueError on a release without the field.

A delivered bucket plan (`megapack.core.buckets`) rides on the object as ``BUCKETS_ATTR``, where
megatron-core passes it untouched to every layer's core attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megapack.core.megatron_release import megatron_release

if TYPE_CHECKING:
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

BUCKETS_ATTR = "megapack_buckets"
"""The attribute of a ``PackedSeqParams`` that holds a delivered bucket plan (a tuple of [n, L])."""

LEFT_OUT_WHERE_ABSENT = frozenset({"cp_group", "pad_between_seqs"})
"""Fields set only where the installed release has them: a release without ``cp_group`` reads the
CP group from the model config; one without ``pad_between_seqs`` passes Transformer Engine no flag
(TE infers it)."""


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

    Fills every field of the module docstring that the installed megatron-core defines: q and kv
    boundaries (real and padded), ``max_seqlen_q/kv``, ``pad_between_seqs`` (whether
    ``cu_seqlens_padded`` is given: decided without reading a tensor), ``cp_group`` (None without
    CP) and ``local_cp_size``. ``buckets``, a delivered bucket plan, is set as the attribute
    ``BUCKETS_ATTR``.

    Raises:
        ValueError: a value the installed release has no field for (``local_cp_size`` before
            megatron-core's hybrid CP), naming it.
    """
    release = megatron_release()
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
        "pad_between_seqs": cu_seqlens_padded is not None,
    }
    known = release.packed_seq_fields
    if not values.keys() <= known:  # a release before megatron-core 0.19
        for name in values.keys() - known:
            if values[name] is not None and name not in LEFT_OUT_WHERE_ABSENT:
                raise ValueError(
                    f"this megatron-core's PackedSeqParams has no field {name!r} (given "
                    f"{values[name]!r}); upgrade megatron-core (local_cp_size needs hybrid CP "
                    "support)"
                )
        values = {k: v for k, v in values.items() if k in known}
    params = release.packed_seq_params(**values)
    if buckets is not None:
        setattr(params, BUCKETS_ATTR, buckets)
    return params
