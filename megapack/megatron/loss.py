"""Losses a pretrain_gpt-style ``forward_step`` returns for packed batches: the same objective
however the step was packed, on every DP, CP and PP layout, in megatron-core's schedule as it is.

megatron-core's GPTModel with ``labels=`` returns every position's cross-entropy ([1, T] for THD,
on the last stage). `normalized_loss` (supervised) and `policy_loss` (the PPO / GRPO surrogate)
weigh those per-token values by a *mode* (`megapack.core.loss_fields`: ``token_mean``,
``sequence_mean``, ``sequence_sum``, ``micro_batch_mean``) and return what megatron-core's
``forward_step`` expects, for either setting of ``calculate_per_token_loss``:

    calculate_per_token_loss=True    (sum, count, report): the schedule sums the counts of every
                                     micro-batch and ``finalize_model_grads`` divides the
                                     gradients by their total over DP x CP. The sum is this CP
                                     share's terms; the count its trained tokens (token_mean), the
                                     documents it counts (sequence modes, on CP rank 0), or 1 for
                                     its micro-batch (micro_batch_mean, on CP rank 0).
    calculate_per_token_loss=False   (loss, report): the schedule multiplies a loss by cp and
                                     divides it by the micro-batches, and DDP averages gradients
                                     over DP x CP, so a token's gradient is 1 / (dp x micro-batches)
                                     of the loss's. The loss is this share's terms divided by the
                                     step's denominator and multiplied by the step's micro-batches
                                     over every DP rank, both from ``loss_step``.

The report is ``{"lm loss": [sum, count]}``, as Megatron-LM's ``train_step`` reduces it either way
(summed over micro-batches and DP x CP, then divided): the mode's value for the step.

What each path needs from the batch (declare `megapack.core.loss_fields.LOSS_FIELDS` in
``fields=`` to deliver ``loss_documents`` and ``loss_step``):

    mode              calculate_per_token_loss=True             False
    token_mean        nothing                                   loss_step
    sequence_mean     loss fields, or one all-reduce of the     loss fields
    sequence_sum      documents' trained tokens over CP
    micro_batch_mean  one all-reduce of the trained tokens over CP (as before)

Without the fields a split document is read as pieces (nothing on the loss's stage says where it
was cut). The functions read no tensor value on the host.

A per-micro-batch mean (each micro-batch's mean over its trained tokens, what a loss function
returning ``(loss_mask * per_token).sum() / loss_mask.sum()`` gives) is ``mode="micro_batch_mean"``
with ``calculate_per_token_loss=False``; its report is ``[this CP share's part of the mean, 1 on CP
rank 0 (else 0)]``, which the reduction above turns into the mean of the micro-batch means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from megapack.core.cp_share import CpLayout
from megapack.core.loss_fields import LossMode, check_mode, token_documents

_FROM_BATCH: Any = object()
"""``cp_group``'s default: the group in the batch's ``packed_seq_params`` (None without one)."""


def normalized_loss(
    batch: Mapping[str, Any],
    per_token: torch.Tensor,
    *,
    mode: LossMode = "token_mean",
    calculate_per_token_loss: bool,
    cp_group: Any = _FROM_BATCH,
    cp_layout: CpLayout = "document",
) -> tuple[Any, ...]:
    """The step's loss over trained tokens in ``mode``, in the form megatron-core's schedule takes.

    Args:
        batch: what `megapack.get_batch_on_this_tp_rank` returned on the loss's stage.
        per_token: megatron-core's per-token loss, ``loss_mask``'s shape (the model's output
            with ``labels=``).
        mode: see `megapack.core.loss_fields.LOSS_MODES`.
        calculate_per_token_loss: megatron-core's setting of that name in the model's config;
            the returned tuple's form follows it, so it must be the config's value.
        cp_group: the context-parallel group; default: ``batch["packed_seq_params"].cp_group``
            (pass it for plain [b, s] batches under CP).
        cp_layout: how the batch was split over CP ranks (``get_batch_on_this_tp_rank``'s).

    Returns:
        ``(sum, count, {"lm loss": report})`` when ``calculate_per_token_loss``, else
        ``(loss, {"lm loss": report})``; see the module docstring.

    Raises:
        ValueError: an unknown mode, a shape that does not match ``loss_mask``, or a mode whose
            path needs the loss fields the batch does not carry (naming what to declare).

    Example, a pretrain_gpt ``forward_step``::

        batch = megapack.get_batch_on_this_tp_rank(it, fields=LOSS_FIELDS)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       packed_seq_params=batch["packed_seq_params"])
        return output, functools.partial(normalized_loss, batch, mode="sequence_mean",
                                         calculate_per_token_loss=config.calculate_per_token_loss)
    """
    return _normalize(
        per_token.float(),
        batch,
        check_mode(mode),
        calculate_per_token_loss,
        _cp_group(batch, cp_group),
        cp_layout,
    )


def policy_loss(
    batch: Mapping[str, Any],
    per_token: torch.Tensor,
    *,
    mode: LossMode = "token_mean",
    clip: float = 0.2,
    calculate_per_token_loss: bool,
    cp_group: Any = _FROM_BATCH,
    cp_layout: CpLayout = "document",
    advantages: str = "advantages",
    old_logprobs: str = "old_logprobs",
) -> tuple[Any, ...]:
    """The clipped policy-gradient surrogate (PPO, GRPO) of every trained token, in ``mode``.

    ``ratio = exp(logp - old_logprobs)`` with ``logp = -per_token``; each token's term is
    ``-min(ratio * A, clip(ratio, 1 - clip, 1 + clip) * A)``, weighed as `normalized_loss` weighs
    cross-entropy. ``advantages`` and ``old_logprobs`` name the batch's per-token fields (declared
    for the last stage). Other arguments and the return as `normalized_loss`.
    """
    terms = _surrogate(batch[advantages], batch[old_logprobs], per_token, clip)
    return _normalize(
        terms,
        batch,
        check_mode(mode),
        calculate_per_token_loss,
        _cp_group(batch, cp_group),
        cp_layout,
    )


def _surrogate(
    advantages: torch.Tensor, old_logprobs: torch.Tensor, per_token: torch.Tensor, clip: float
) -> torch.Tensor:
    if advantages.shape != per_token.shape or old_logprobs.shape != per_token.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} and old_logprobs {tuple(old_logprobs.shape)} "
            f"must have the per-token loss's shape {tuple(per_token.shape)}: declare them per "
            "token for the last stage (megapack.BatchField(name, 'token', dtype, 'last', at=...))"
        )
    ratio = torch.exp(-per_token.float() - old_logprobs.float())  # logp = -per_token
    adv = advantages.float()
    return -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv)


def _cp_group(batch: Mapping[str, Any], cp_group: Any) -> Any:
    if cp_group is not _FROM_BATCH:
        return cp_group
    return getattr(batch.get("packed_seq_params"), "cp_group", None)


def _normalize(
    values: torch.Tensor,
    batch: Mapping[str, Any],
    mode: LossMode,
    per_token_loss: bool,
    cp_group: Any,
    cp_layout: CpLayout,
) -> tuple[Any, ...]:
    if not isinstance(per_token_loss, bool):
        raise TypeError(
            f"calculate_per_token_loss must be megatron-core's config flag (True or False), got "
            f"{per_token_loss!r}"
        )
    mask = batch["loss_mask"]
    if values.shape != mask.shape:
        raise ValueError(
            f"the per-token loss has shape {tuple(values.shape)} but loss_mask has "
            f"{tuple(mask.shape)}: pass the model's output computed with labels="
        )
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    trained = mask != 0
    terms = values * mask.float()
    lead = cp_rank == 0  # the CP rank that counts a micro-batch's or a document's 1
    if mode == "micro_batch_mean":
        count = mask.float().sum().detach().clone()
        if cp_size > 1:
            dist.all_reduce(count, group=cp_group)
        total = terms.sum() / count.clamp(min=1.0)
        return _returned(total, total, _one(lead, mask), per_token_loss)
    documents, step = _loss_fields(batch, mode, per_token_loss)
    doc = None
    if mode != "token_mean":
        doc = token_documents(batch, cp_size=cp_size, cp_rank=cp_rank, layout=cp_layout)
    if documents is None and doc is not None:  # derived: the documents' trained tokens over CP
        segments = _segments(batch)
        counts = torch.zeros(segments, dtype=torch.float32, device=mask.device)
        counts.index_add_(0, doc.reshape(-1), trained.reshape(-1).float())
        if cp_size > 1:
            dist.all_reduce(counts, group=cp_group)
        documents = torch.stack([counts, (counts > 0).float()], dim=1)
    if mode == "token_mean":
        total, count = terms.sum(), trained.sum()
    else:
        assert documents is not None and doc is not None
        per_document = documents[:, 0].to(values.dtype).clamp(min=1.0)
        if mode == "sequence_mean":
            terms = terms / per_document[doc]
        total = terms.sum()
        count = documents[:, 1].sum() if lead else torch.zeros((), device=mask.device)
    if per_token_loss:
        return _returned(total, total, count, per_token_loss)
    assert step is not None  # _loss_fields refuses the 2-tuple path without the fields
    denominator = step[0, 0 if mode == "token_mean" else 1].to(values.dtype).clamp(min=1.0)
    micro_batches = step[0, 2].to(values.dtype)  # of the step, over every DP rank
    return _returned(total, total * micro_batches / denominator, count, per_token_loss)


def _loss_fields(
    batch: Mapping[str, Any], mode: LossMode, per_token_loss: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch's ``loss_documents`` and ``loss_step``, checked, or (None, None) when the path
    does without them; ValueError where it cannot."""
    documents, step = batch.get("loss_documents"), batch.get("loss_step")
    if documents is None or step is None:
        if not per_token_loss:
            raise ValueError(
                f"mode={mode!r} with calculate_per_token_loss=False needs the step's denominators, "
                "which this batch does not carry: declare fields=megapack.LOSS_FIELDS and deliver "
                "them (PackedDataset(..., loss_fields=True), megapack.with_loss_fields(iterator, "
                "...)), or set calculate_per_token_loss=True (the schedule then divides)"
            )
        return None, None
    segments = _segments(batch)
    if tuple(documents.shape) != (segments, 2):
        raise ValueError(
            f"loss_documents has shape {tuple(documents.shape)} but the batch has {segments} "
            "document segments: one row (trained tokens, counted) per segment"
        )
    if tuple(step.shape) != (1, 3):
        raise ValueError(
            f"loss_step has shape {tuple(step.shape)}; expected [1, 3] (trained tokens, "
            "documents, micro-batches of the step)"
        )
    return documents, step


def _segments(batch: Mapping[str, Any]) -> int:
    """The batch's document segments: its buffer boundaries' count less one, or its rows."""
    cu = batch.get("cu_seqlens_padded")
    cu = cu if cu is not None else batch.get("cu_seqlens")
    return int(batch["loss_mask"].shape[0]) if cu is None else int(cu.numel()) - 1


def _one(lead: bool, like: torch.Tensor) -> torch.Tensor:
    return torch.ones((), device=like.device) if lead else torch.zeros((), device=like.device)


def _returned(
    total: torch.Tensor, loss: torch.Tensor, count: torch.Tensor, per_token_loss: bool
) -> tuple[Any, ...]:
    """The schedule's tuple: the report [sum, count] is detached (the schedule divides in place)."""
    report = torch.stack([total.detach().float(), count.detach().float()])
    if per_token_loss:
        return total, count.to(torch.int32), {"lm loss": report}
    return loss, {"lm loss": report}
