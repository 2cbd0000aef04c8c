"""The losses (`megapack.megatron.loss`: `normalized_loss`, `policy_loss`) in one process: every
mode's value on both of megatron-core's loss paths, what each refuses, and the policy surrogate's
clipping. The loss fields they read: test_loss_fields.py; on megatron-core's schedules over DP, CP,
PP and TP: tests/functional/test_loss_normalization.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from megapack import PackedBatch
from megapack.core.loss_fields import LOSS_MODES, segment_trained, step_loss_fields
from megapack.megatron import normalized_loss, policy_loss
from megapack.testing.host_reads import host_reads


def _batch(docs: list[Any], fields: bool, **kw: Any) -> dict[str, Any]:
    """A delivered-looking batch of one micro-batch that is the whole step (cp = 1)."""
    b = PackedBatch.from_documents(docs, **kw)
    out: dict[str, Any] = {"loss_mask": b.loss_mask, "cu_seqlens": b.cu_seqlens,
                           "cu_seqlens_padded": b.cu_seqlens_padded, "packed_seq_params": None}  # fmt: skip
    if fields:
        buffer = b.cu_seqlens_padded if b.cu_seqlens_padded is not None else b.cu_seqlens
        documents, step = step_loss_fields([segment_trained(buffer, b.loss_mask)])
        out |= {"loss_documents": torch.from_numpy(documents[0]),
                "loss_step": torch.from_numpy(step)[None]}  # fmt: skip
    return out


DOCS = [{"tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}, [5, 6], [7], [8, 9, 10, 11, 12]]
# labels trained: doc 0 positions 1, 2 (tokens 3, 4); doc 1 position 0; doc 2 none; doc 3 0..3


@pytest.mark.parametrize("per_token_loss", [False, True])
@pytest.mark.parametrize("fields", [True, False], ids=["fields", "derived"])
def test_loss_modes_values_on_both_paths(per_token_loss: bool, fields: bool) -> None:
    batch = _batch(DOCS, fields, seq_len=16)
    per_token = torch.arange(16, dtype=torch.float32)[None] / 10
    l = per_token[0].tolist()  # noqa: E741
    doc_terms = [[l[1], l[2]], [l[4]], [], [l[7], l[8], l[9], l[10]]]
    flat = [x for d in doc_terms for x in d]
    want = {
        "token_mean": (sum(flat), len(flat)),
        "sequence_mean": (sum(sum(d) / len(d) for d in doc_terms if d), 3),
        "sequence_sum": (sum(flat), 3),
        "micro_batch_mean": (sum(flat) / len(flat), 1),
    }
    for mode in LOSS_MODES:
        if not fields and not per_token_loss and mode != "micro_batch_mean":
            with pytest.raises(ValueError, match="needs the step's denominators"):
                normalized_loss(batch, per_token, mode=mode, calculate_per_token_loss=False)
            continue
        with host_reads() as reads:
            out = normalized_loss(
                batch, per_token, mode=mode, calculate_per_token_loss=per_token_loss
            )
        assert reads.by_module() == {}, reads.report()
        total, count = want[mode]
        assert out[-1]["lm loss"].tolist() == pytest.approx([total, count])
        if per_token_loss:
            assert out[0].item() == pytest.approx(total) and out[1].item() == count
            assert out[1].dtype == torch.int32
        else:  # one micro-batch, one DP rank: the loss is the mode's value itself
            assert len(out) == 2 and out[0].item() == pytest.approx(total / count)


def test_loss_modes_of_a_filler_micro_batch_are_zero_not_nan() -> None:
    filler = [{"tokens": [0] * 8, "loss_mask": [0] * 8}]
    batch = _batch(filler, True, seq_len=8)
    per_token = torch.full((1, 8), float("inf"))  # would poison a mean that read it
    per_token[0, :] = 3.0
    for mode in LOSS_MODES:
        for per_token_loss in (False, True):
            out = normalized_loss(batch, per_token.requires_grad_(), mode=mode,
                                  calculate_per_token_loss=per_token_loss)  # fmt: skip
            assert out[0].item() == 0.0 and not torch.isnan(out[0])
            out[0].backward()
            assert torch.equal(per_token.grad, torch.zeros(1, 8))
            per_token.grad = None


def test_loss_report_is_not_the_returned_tensor() -> None:
    batch = _batch([[1, 2, 3], [4, 5]], True, seq_len=8)
    for mode in LOSS_MODES:
        for per_token_loss in (False, True):
            out = normalized_loss(batch, torch.ones(1, 8), mode=mode,
                                  calculate_per_token_loss=per_token_loss)  # fmt: skip
            report, loss = out[-1]["lm loss"].clone(), out[0]
            loss /= 2  # the schedule divides the loss in place by its micro-batches
            assert torch.equal(out[-1]["lm loss"], report), (mode, per_token_loss)


def test_loss_cp_group_defaults_to_the_batch_packed_seq_params() -> None:
    from types import SimpleNamespace

    from megapack.megatron.loss import _cp_group

    group = object()
    assert (
        _cp_group({"packed_seq_params": SimpleNamespace(cp_group=group)}, loss_default()) is group
    )
    assert _cp_group({"packed_seq_params": None}, loss_default()) is None
    assert _cp_group({"packed_seq_params": SimpleNamespace(cp_group=group)}, None) is None


def loss_default() -> Any:
    from megapack.megatron.loss import _FROM_BATCH

    return _FROM_BATCH


def test_loss_refuses_what_does_not_fit_naming_it() -> None:
    batch = _batch(DOCS, True, seq_len=16)
    per_token = torch.zeros(1, 16)
    with pytest.raises(ValueError, match=r"mode='mean'"):
        normalized_loss(batch, per_token, mode="mean", calculate_per_token_loss=True)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="calculate_per_token_loss must be megatron-core's config flag"
    ):
        normalized_loss(batch, per_token, calculate_per_token_loss=1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"per-token loss has shape \(1, 15\) but loss_mask has \(1, 16\)"
    ):
        normalized_loss(batch, per_token[:, 1:], calculate_per_token_loss=True)
    bad = batch | {"loss_documents": batch["loss_documents"][:2]}
    with pytest.raises(ValueError, match=r"loss_documents has shape \(2, 2\) but the batch has 5"):
        normalized_loss(bad, per_token, mode="sequence_mean", calculate_per_token_loss=True)
    bad = batch | {"loss_step": batch["loss_step"][0]}
    with pytest.raises(ValueError, match=r"loss_step has shape \(3,\); expected \[1, 3\]"):
        normalized_loss(bad, per_token, calculate_per_token_loss=False)


def test_loss_policy_surrogate_clips_on_both_sides_in_every_mode() -> None:
    batch = _batch([[1, 2, 3, 4, 5]], True, seq_len=5)
    logp = torch.full((1, 5), -1.0)  # per-token loss 1
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0]])
    old = torch.tensor([[-2.0, -0.5, -2.0, -0.5, 0.0]])  # ratios e, e^-0.5, e, e^-0.5
    batch |= {"advantages": adv, "old_logprobs": old}
    # A > 0: min(r, clip(r)) -> 1.2 (r = e), 0.607 (r < 0.8 is not clipped from below)
    # A < 0: -max(...) terms -> -e (r = e: unclipped max), -0.8
    terms = [-1.2, -np.exp(-0.5), np.e, 0.8]
    out = policy_loss(batch, -logp, mode="token_mean", calculate_per_token_loss=True)
    assert out[0].item() == pytest.approx(sum(terms), rel=1e-6)
    out = policy_loss(batch, -logp, mode="sequence_mean", calculate_per_token_loss=False)
    assert out[0].item() == pytest.approx(sum(terms) / 4, rel=1e-6)


def test_loss_two_tuple_path_scales_by_the_steps_micro_batches() -> None:
    # one of 4 micro-batches of a step of 10 trained tokens and 3 documents: the schedule divides
    # the loss by 4 (and DDP by dp), so the loss carries the factor back
    batch = _batch(DOCS, True, seq_len=16) | {"loss_step": torch.tensor([[10, 3, 4]])}
    per_token = torch.ones(1, 16)
    loss, _ = normalized_loss(batch, per_token, mode="token_mean", calculate_per_token_loss=False)
    assert loss.item() == pytest.approx(7 * 4 / 10)
    loss, _ = normalized_loss(batch, per_token, mode="sequence_sum", calculate_per_token_loss=False)
    assert loss.item() == pytest.approx(7 * 4 / 3)
    # micro_batch_mean of one trained token is that token's loss, not half of it
    one = _batch([[1, 2]], False, seq_len=4)
    loss, report = normalized_loss(one, torch.full((1, 4), 5.0), mode="micro_batch_mean",
                                   calculate_per_token_loss=False)  # fmt: skip
    assert loss.item() == 5.0 and report["lm loss"].tolist() == [5.0, 1.0]
    # half the fields is no fields: the 2-tuple path says what is missing
    with pytest.raises(ValueError, match="needs the step's denominators"):
        normalized_loss({k: v for k, v in batch.items() if k != "loss_step"}, per_token,
                        calculate_per_token_loss=False)  # fmt: skip
