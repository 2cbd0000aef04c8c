"""The batch contract, one concept a module:

    fields.py       every field a batch carries, as data (`BatchField`, `BUILTIN_FIELDS`, `Stage`,
                    `Schema`)
    batch.py        `PackedBatch`: one THD micro-batch of packed documents (its ``extras``: extras.py)
    intake.py       what a data iterator may yield, checked and made a `Batch` (`to_batch`)
    rows.py         Megatron SFT-style packed rows merged into one THD row (`merge_rows`)
    cp_share.py     the positions of a row each context-parallel rank keeps (`CpLayout`,
                    `take_share`, `cp_indices`); cp_pad.py the multiple documents are padded to
    loss_fields.py  what a loss needs to weigh a token the same however the step was packed
    static.py       static shapes for CUDA graphs (`StaticShape`); buckets.py length buckets;
                    capture.py whether a CUDA-graph capture is under way
    seq_params.py   megatron-core's ``PackedSeqParams`` for a packed batch, any release
    checks.py       argument checks: TypeError for a wrong type, ValueError for a bad value
    errors.py       the exceptions megapack raises across ranks
    quiet.py        known-harmless megatron-core warnings, filtered

May import torch, numpy and megatron-core's ``PackedSeqParams`` (lazily); never torch.distributed,
and nothing else of megapack: every other package builds on this one.
"""
