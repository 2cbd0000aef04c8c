"""Megatron-LM main's pretrain_gpt.py, the part that gets a batch: ``get_batch`` and the start of
``forward_step`` (up to the model call). Imports as pretrain_gpt.py does, through the stand-ins
(`megatron_core`, `megatron_training`); the one line docs/megatron.md adds runs after this file.
"""

from __future__ import annotations

from typing import Any

from megapack.core.quiet import quiet_megatron
from tests.functional.callers.megatron_core import (
    flatten_batch_for_packed_sequences,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
    mtp_on_this_rank_func,
)
from tests.functional.callers.megatron_training import get_args, is_first_or_last_pipeline_stage

with quiet_megatron():
    from megatron.core import mpu
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.parallel_state import (
        get_context_parallel_group,
        get_hybrid_data_context_parallel_groups,
    )

BATCH_KEYS = ["attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels",
              "local_cp_size", "loss_mask", "max_seqlen", "position_ids", "tokens"]  # fmt: skip


def get_batch(data_iterator: Any, vp_stage: int | None = None) -> Any:
    """Generate a batch."""
    args = get_args()
    cp_size = args.context_parallel_size
    tp_rank = mpu.get_tensor_model_parallel_rank()
    is_sft = args.sft
    has_cu_seqlens = is_sft or args.dataloader_inter_document_masking
    create_attention_mask_in_dataloader = args.create_attention_mask_in_dataloader
    mtp_on_this_rank = mtp_on_this_rank_func(
        layout=args.pipeline_model_parallel_layout,
        mtp_num_layers=args.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )
    is_hybrid_cp = args.hybrid_context_parallel

    if (
        not is_first_or_last_pipeline_stage(vp_stage)
        and not mtp_on_this_rank
        and not has_cu_seqlens
    ):
        return [None for _ in BATCH_KEYS]

    batch: dict[str, Any] = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        for key in BATCH_KEYS:  # pretrain_gpt: .cuda(non_blocking=True); here: where they are
            batch[key] = batch[key] if key in batch and batch[key] is not None else None

    batch = get_batch_on_this_tp_rank(
        batch,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        has_cu_seqlens=has_cu_seqlens,
        is_hybrid_cp=is_hybrid_cp,
        create_attention_mask_in_dataloader=create_attention_mask_in_dataloader,
        cp_size=cp_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_on_this_rank,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )

    batch = flatten_batch_for_packed_sequences(batch)

    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_on_this_rank:
        assert has_cu_seqlens
        return (None, batch["cu_seqlens"], batch["cu_seqlens_padded"], None, None, None, None,
                batch["max_seqlen"], None, None)  # fmt: skip

    batch = get_batch_on_this_cp_rank(
        batch,
        is_hybrid_cp=is_hybrid_cp,
        cp_group=get_context_parallel_group(),
        hybrid_cp_group_func=get_hybrid_data_context_parallel_groups,
        use_per_sequence_balancing=args.dataloader_inter_document_masking and not is_sft,
    )
    return [batch[key] for key in BATCH_KEYS]


def forward_inputs(data_iterator: Any, vp_stage: int | None = None) -> dict[str, Any]:
    """``forward_step`` up to ``model(...)``: what it passes the model (PackedSeqParams built
    from the batch as pretrain_gpt builds it: ``squeeze(0)``, ``int(max_seqlen.item())``)."""
    args = get_args()
    (attention_mask, cu_seqlens, cu_seqlens_padded, hybrid_cp_group, labels, local_cp_size,
     loss_mask, max_seqlen, position_ids, tokens) = get_batch(data_iterator, vp_stage)  # fmt: skip
    packed_seq_params = None
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.squeeze(0)
        if cu_seqlens_padded is not None:
            cu_seqlens_padded = cu_seqlens_padded.squeeze(0)
        cu_seqlens_for_params = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        packed_seq_params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens_for_params,
            cu_seqlens_kv=cu_seqlens_for_params,
            cu_seqlens_q_padded=cu_seqlens_padded,
            cu_seqlens_kv_padded=cu_seqlens_padded,
            max_seqlen_q=int(max_seqlen.item()),
            max_seqlen_kv=int(max_seqlen.item()),
            local_cp_size=int(local_cp_size.item()) if local_cp_size is not None else None,
            cp_group=hybrid_cp_group,
        )  # pretrain_gpt also passes tokens_per_sample=args.seq_length (megatron-core 0.19 on)
    del args
    return {"tokens": tokens, "position_ids": position_ids, "attention_mask": attention_mask,
            "labels": labels, "loss_mask": loss_mask, "packed_seq_params": packed_seq_params}  # fmt: skip
