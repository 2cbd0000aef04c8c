"""Megatron-LM's pretrain_gpt.py before its PR #4103 (megatron-core up to 0.18's era): ``get_batch``
returning ``(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params)``. Its
``get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=...)`` came from
``megatron.training.utils`` and read Megatron's global args; there is none here to run, so the
name is None until the guide's line binds megapack's. Imports through the stand-ins.
"""

from __future__ import annotations

from typing import Any

from megapack.core.quiet import quiet_megatron
from tests.functional.callers.megatron_core import (
    get_batch_on_this_cp_rank_pre_4103 as get_batch_on_this_cp_rank,
)
from tests.functional.callers.megatron_core import (
    get_thd_batch_on_this_cp_rank,
    mtp_on_this_rank_func,
)
from tests.functional.callers.megatron_training import get_args, is_first_or_last_pipeline_stage

with quiet_megatron():
    from megatron.core.packed_seq_params import PackedSeqParams

get_batch_on_this_tp_rank: Any = None  # megatron.training.utils' (Megatron-LM's global args)


def get_batch(data_iterator: Any, vp_stage: int | None = None) -> Any:
    """Generate a batch."""
    args = get_args()
    is_packed_sequence = args.sft
    mtp = mtp_on_this_rank_func(layout=args.pipeline_model_parallel_layout,
                                mtp_num_layers=args.mtp_num_layers, ignore_virtual=False,
                                vp_stage=vp_stage)  # fmt: skip
    if not is_first_or_last_pipeline_stage(vp_stage) and not is_packed_sequence and not mtp:
        return None, None, None, None, None, None

    batch = get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=mtp)

    cu_seqlens = batch.pop("cu_seqlens", None)
    cu_seqlens_padded = batch.pop("cu_seqlens_padded", None)
    max_seqlen = batch.pop("max_seqlen", None)
    local_cp_size = batch.pop("local_cp_size", None)
    if local_cp_size is not None:
        local_cp_size = int(local_cp_size.item())

    if cu_seqlens is not None:
        assert cu_seqlens.dim() == 2 and cu_seqlens.shape[0] == 1, (
            "micro-batch-size must be 1 for packing"
        )
        cu_seqlens = cu_seqlens[0]
        assert max_seqlen.dim() == 1

    if not is_first_or_last_pipeline_stage(vp_stage) and is_packed_sequence:
        return (
            None,
            None,
            None,
            None,
            None,
            PackedSeqParams(
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_kv=cu_seqlens,
                max_seqlen_q=int(max_seqlen[0].item()),
                max_seqlen_kv=int(max_seqlen[0].item()),
                qkv_format="thd",
            ),
        )

    if cu_seqlens is None and local_cp_size is None:
        batch = get_batch_on_this_cp_rank(batch)
        packed_seq_params = None
    elif local_cp_size is None:  # packed THD
        batch, packed_seq_params = get_thd_batch_on_this_cp_rank(
            batch, cu_seqlens, cu_seqlens_padded, max_seqlen
        )
    else:  # hybrid CP: megapack refuses it before this point
        raise NotImplementedError("hybrid CP")

    return (*batch.values(), packed_seq_params)
