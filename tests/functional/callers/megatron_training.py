"""Megatron-LM's ``megatron.training`` as the re-created callers use it: ``get_args`` and
``is_first_or_last_pipeline_stage``. megatron-core 0.16.1 ships no ``megatron.training`` and
0.19.2's takes ~12 s to import, so `using` stands a small module in for it while a test runs (the
callers, and `megapack.megatron.pretrain_gpt_get_batch` without ``args=``, import it by name).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

from megapack.core.quiet import quiet_megatron

with quiet_megatron():
    from megatron.core import parallel_state as mpu

_ARGS: list[Any] = []


def get_args() -> Any:
    """The arguments `using` set (Megatron-LM's global ``args``)."""
    if not _ARGS:
        raise RuntimeError("no Megatron-LM arguments set: run inside megatron_training.using(args)")
    return _ARGS[-1]


def is_first_or_last_pipeline_stage(vp_stage: int | None) -> bool:
    """Megatron-LM's ``megatron.training.utils.is_first_or_last_pipeline_stage``."""
    ignore_virtual = vp_stage is None
    return mpu.is_pipeline_first_stage(
        ignore_virtual=ignore_virtual, vp_stage=vp_stage
    ) or mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)


@contextlib.contextmanager
def using(args: Any) -> Iterator[None]:
    """``megatron.training`` (this module's names) in ``sys.modules`` with ``args``, restored after."""
    stand_in = types.ModuleType("megatron.training")
    stand_in.get_args = get_args  # type: ignore[attr-defined]
    before = sys.modules.get("megatron.training")
    sys.modules["megatron.training"] = stand_in
    _ARGS.append(args)
    try:
        yield
    finally:
        _ARGS.pop()
        if before is None:
            sys.modules.pop("megatron.training", None)
        else:
            sys.modules["megatron.training"] = before


def sft_args(**overrides: Any) -> types.SimpleNamespace:
    """Megatron-LM's arguments of a plain ``--sft`` run (what pretrain_gpt's get_batch reads)."""
    args = dict(
        context_parallel_size=1, sft=True, dataloader_inter_document_masking=False,
        create_attention_mask_in_dataloader=False, hybrid_context_parallel=False,
        micro_batch_size=1, seq_length=16, pipeline_model_parallel_size=1,
        sequence_parallel=False, mtp_num_layers=None, pipeline_model_parallel_layout=None,
    )  # fmt: skip
    return types.SimpleNamespace(**{**args, **overrides})
