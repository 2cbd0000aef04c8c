"""The batch contract: field declarations, `PackedBatch`, Megatron's batch dicts, CP shares, PackedSeqParams.

May import torch, numpy and megatron-core's ``PackedSeqParams`` (lazily); never torch.distributed,
and nothing else of megapack: every other package builds on this one.
"""
