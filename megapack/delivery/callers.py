"""The callers' conventions: how Megatron-LM and Megatron-Bridge ask for a batch, each a thin
adapter onto megapack's one delivery (`megapack.delivery.get_batch`).

`megapack.get_batch_on_this_tp_rank` takes four forms, told apart by their arguments alone:

    form                         the call                                     returns
    ---------------------------  -------------------------------------------  ---------------------------
    megapack                     (data_iterator | None, *, megapack's         megapack's dict (OUTPUT_KEYS)
                                 keywords)
    Megatron-LM (megatron-core   (batch dict | {}, has_cu_seqlens=...,        Megatron's 10 keys (below),
    0.19's utils, PR #4103 on)   ... every keyword pretrain_gpt.py passes)    whole rows: CP split after
    Megatron-LM before PR #4103  (data_iterator, mtp_on_this_rank=...)        its dict, in its key order
    Megatron-Bridge              (data_iterator, cfg, use_mtp=False, *,       Bridge's keys and its packed
                                 pg_collection)                               ones (cu_seqlens_q, ...)

A dict first is Megatron-LM's form (an iterator never is a Mapping); ``mtp_on_this_rank=`` (or a
bool second) with an iterator is the older form; ``cfg`` (second, or ``cfg=``/``use_mtp=``) is
Bridge's. Anything mixing two forms, a Megatron-LM keyword beside an iterator, or one of
megapack's delivery options (``fields``, ``packed``, ...) in a caller's form is a TypeError naming
the argument; ``topology=``, ``pg_collection=`` and ``timeout=`` say where and how long in every
form (Bridge's requires ``pg_collection=``).

Every form reads data only on the TP source and delivers through the same call; each adapter
only (1) finds the topology (``topology=``, ``pg_collection=``, else megatron-core's
``parallel_state``, by the physical pipeline stage as Megatron's functions do), (2) checks the
caller's keywords against it (refusing what megapack cannot honour: Megatron's hybrid context
parallelism), (3) maps the caller's item keys onto megapack's inside the source's ``next()`` (so
a bad item is the source's error and `RemoteDataError` on its peers, as any other), and (4) lays
the result out as the caller reads it. The callers split context parallelism themselves after
this call, so their forms deliver whole rows; the whole replacements below let megapack split.

Megatron-LM's form returns, on every TP rank and stage, ``tokens``, ``labels``, ``loss_mask``,
``position_ids``, ``attention_mask``, ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``,
``local_cp_size`` and ``hybrid_cp_group``: packed rows already merged into THD [1, b*s] with
``cu_seqlens`` [1, n+1] int32 (sentinels gone: megatron-core's
``flatten_batch_for_packed_sequences`` after it changes nothing, on middle stages too, where its
own path keeps a -1 sentinel) and ``max_seqlen`` a [1] int32 CPU tensor (``.max()`` and
``.item()`` work, the latter without a device sync).

Worked example, s=4, mbs 2, ``cu_seqlens [[0, 3, 4, -1], [0, 4, -1, -1]]``: every stage gets
``cu_seqlens [[0, 3, 4, 8]]`` and ``max_seqlen tensor([4])``; the first stage ``tokens`` [1, 8].

Whole replacements, so that the one line changed in a training script is the function itself:
`pretrain_gpt_get_batch` for Megatron-LM's ``pretrain_gpt.get_batch(data_iterator, vp_stage)``
(its ``BATCH_KEYS`` list) and `bridge_get_batch` for Bridge's ``gpt_step.get_batch`` (its
6-tuple); both take megapack's context-parallel share and need no call after them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megapack.core.batch import PackedBatch
from megapack.core.checks import check_int
from megapack.core.cp_share import cp_indices
from megapack.core.fields import BatchField, Stage
from megapack.delivery.deliver import deliver
from megapack.distributed.topology import Topology, resolve_topology

__all__ = ["MEGATRON_BATCH_KEYS", "Form", "bridge_get_batch", "form_of", "pretrain_gpt_get_batch"]

MEGATRON_BATCH_KEYS: tuple[str, ...] = (
    "attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels",
    "local_cp_size", "loss_mask", "max_seqlen", "position_ids", "tokens",
)  # fmt: skip
"""pretrain_gpt.py's ``BATCH_KEYS``: the order its ``get_batch`` returns the fields in."""

_MEGATRON_SENT = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask",
                  "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size")  # fmt: skip
"""The item keys Megatron-LM's function transfers; it drops every other (BlendedDataset's
``dataset_id`` included), so its form does too."""

_BRIDGE_PACKED = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                  "max_seqlen_q", "max_seqlen_kv")  # fmt: skip
"""Bridge's packed-sequence keys (its "current" convention, which its gpt_step reads first)."""

PADDING_MASK = BatchField("padding_mask", "ragged", torch.uint8, "all")
"""Bridge's alignment-padding mask of a packed batch, flattened ([b*s], 0 or 1), or [0] when the
item has none: its length, known from the frame's header, says which without a device sync."""

_HYBRID_CP = (
    "megapack cannot honour Megatron-LM's hybrid context parallelism (--hybrid-context-parallel): "
    "the CP group of each micro-batch is chosen after delivery from its local_cp_size, and its "
    "sequence length varies; keep megatron.core.utils.get_batch_on_this_tp_rank for hybrid-CP "
    "runs, or use megapack's context parallelism (docs/context-parallelism.md)"
)


class Form(enum.Enum):
    """A way of calling `megapack.get_batch_on_this_tp_rank` (see the module docstring)."""

    MEGAPACK = "megapack"
    MEGATRON = "Megatron-LM"
    MEGATRON_PRE_4103 = "Megatron-LM before PR #4103"
    BRIDGE = "Megatron-Bridge"


def _signature(*required: str, **optional: Any) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(n, kind) for n in required]
    params += [inspect.Parameter(n, kind, default=d) for n, d in optional.items()]
    return inspect.Signature(params)


_MEGATRON_SIGNATURE = _signature(
    "batch", "has_cu_seqlens", "is_hybrid_cp", "create_attention_mask_in_dataloader",
    "broadcast_src_rank", "broadcast_group", "cp_size", "tp_rank", "micro_batch_size",
    "seq_length", "mtp_on_this_rank", pipeline_model_parallel_size=1,
    is_pipeline_first_stage=False, is_pipeline_last_stage=False,
)  # fmt: skip
_SIGNATURES: dict[Form, inspect.Signature] = {
    Form.MEGATRON: _MEGATRON_SIGNATURE,
    Form.MEGATRON_PRE_4103: _signature("data_iterator", mtp_on_this_rank=False),
    Form.BRIDGE: _signature("data_iterator", "cfg", use_mtp=False),
}
"""Each caller's parameters as its own function declares them (megatron-core 0.19.2's
``megatron.core.utils``; Megatron-LM's ``megatron/training/utils.py`` before PR #4103; Bridge's
``training/utils/batch_utils.py``), less the keywords megapack's signature has itself."""

_MEGATRON_ONLY = frozenset(_SIGNATURES[Form.MEGATRON].parameters) - {"batch", "mtp_on_this_rank"}


def form_of(first: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Form:
    """Which form a call ``get_batch_on_this_tp_rank(first, *args, **kwargs)`` is (megapack's own
    keywords left out of ``kwargs``), from the arguments alone.

    Raises:
        TypeError: the arguments fit no form, or mix two (naming them and the forms).

    Example:
        >>> form_of({}, (), {"has_cu_seqlens": True}).value
        'Megatron-LM'
        >>> form_of(iter([]), (), {"mtp_on_this_rank": False}).value
        'Megatron-LM before PR #4103'
    """
    if isinstance(first, Mapping):
        return Form.MEGATRON
    if megatron := sorted(set(kwargs) & _MEGATRON_ONLY):
        raise TypeError(
            f"get_batch_on_this_tp_rank got Megatron-LM's keywords {megatron} with a "
            f"{type(first).__name__} first: Megatron-LM's form takes the batch dict first "
            "(next(data_iterator) on TP rank 0, {} on the other TP ranks), as pretrain_gpt.py "
            "passes it; megapack's own form takes the iterator and megapack's keywords"
        )
    second = args[0] if args else None
    old = "mtp_on_this_rank" in kwargs or isinstance(second, bool)
    bridge = "cfg" in kwargs or "use_mtp" in kwargs or (bool(args) and not isinstance(second, bool))
    if old and bridge:
        raise TypeError(
            "get_batch_on_this_tp_rank: ambiguous call, it mixes Megatron-LM's older form "
            "(data_iterator, mtp_on_this_rank=...) and Megatron-Bridge's (data_iterator, cfg, "
            f"use_mtp, *, pg_collection): got {len(args)} more positional arguments and keywords "
            f"{sorted(kwargs)}; pass one form's arguments"
        )
    if unknown := sorted(set(kwargs) - {"mtp_on_this_rank", "cfg", "use_mtp"}):
        raise TypeError(
            f"get_batch_on_this_tp_rank got unexpected keywords {unknown}: megapack's form takes "
            "topology, pg_collection, timeout, cp_layout, sequence_parallel, packed, fields, "
            "static; Megatron-LM's a batch dict first and its keywords; its older form "
            "mtp_on_this_rank; Megatron-Bridge's cfg, use_mtp, pg_collection"
        )
    if old:
        return Form.MEGATRON_PRE_4103
    return Form.BRIDGE if bridge else Form.MEGAPACK


def get_batch_in_form(
    first: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    topology: Topology | None,
    pg_collection: Any,
    timeout: float | None,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """`get_batch_on_this_tp_rank` in a caller's form (`form_of`): its checks, the one
    delivery, its layout. ``options``: megapack's delivery keywords as passed (none of them may
    differ from its default in a caller's form)."""
    form = form_of(first, args, kwargs)
    if form is Form.MEGAPACK:  # (get_batch_on_this_tp_rank calls this only for the others)
        return _deliver(
            first, topology=resolve_topology(topology, pg_collection), timeout=timeout, **options
        )
    given = sorted(name for name, value in options.items() if not _is_default(name, value))
    if given:
        raise TypeError(
            f"get_batch_on_this_tp_rank in {form.value}'s form got megapack's options {given}, "
            "which only megapack's own form takes (an iterator first, keywords only): drop them, "
            "or call megapack's form"
        )
    try:
        bound = _SIGNATURES[form].bind(first, *args, **kwargs).arguments
    except TypeError as exc:
        raise TypeError(
            f"get_batch_on_this_tp_rank in {form.value}'s form: {exc} (the call's other "
            f"arguments: {sorted(_SIGNATURES[form].parameters)})"
        ) from None
    if form is Form.MEGATRON:
        return _megatron(bound, topology=topology, pg_collection=pg_collection, timeout=timeout)
    if form is Form.MEGATRON_PRE_4103:
        return _megatron_pre_4103(
            bound["data_iterator"],
            _flag("mtp_on_this_rank", bound.get("mtp_on_this_rank", False)),
            topology=topology,
            pg_collection=pg_collection,
            timeout=timeout,
        )
    if pg_collection is None:
        raise TypeError(
            "get_batch_on_this_tp_rank in Megatron-Bridge's form needs pg_collection= (keyword "
            "only, as Bridge's own: get_pg_collection(model))"
        )
    if topology is not None:
        raise ValueError(
            "get_batch_on_this_tp_rank in Megatron-Bridge's form got topology= beside its "
            "pg_collection=: the pg_collection says where this rank is; drop topology="
        )
    return _bridge_tp(bound, pg_collection=pg_collection, timeout=timeout)


# -- Megatron-LM ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _MegatronData:
    """What Megatron-LM says its data is (its keywords, or pretrain_gpt's ``args``), checked."""

    has_cu_seqlens: bool
    create_attention_mask: bool
    micro_batch_size: int
    seq_length: int

    def item(self, item: Any, *, refuse: str | None = None) -> Any:
        """An item of Megatron's data as megapack's intake takes it, checked against what the
        job says (run on the TP source inside ``next()``: a failure reaches every TP rank)."""
        if refuse is not None:
            raise ValueError(refuse)
        got: tuple[int, ...] | None = None
        if isinstance(item, PackedBatch):
            got = (1, item.num_tokens)
            if not self.has_cu_seqlens:
                raise ValueError(
                    "has_cu_seqlens=False but the data is a megapack.PackedBatch (packed, with "
                    "cu_seqlens): pass --sft or --dataloader-inter-document-masking"
                )
        elif isinstance(item, Mapping):
            if not item:
                raise ValueError(
                    "the batch is empty on the TP source (TP rank 0): pass the batch "
                    "next(data_iterator) gave there (pretrain_gpt.py does) and {} on the other "
                    "TP ranks"
                )
            if item.get("local_cp_size") is not None:
                raise ValueError(f"the batch has local_cp_size, a hybrid-CP batch: {_HYBRID_CP}")
            has = item.get("cu_seqlens") is not None
            if has != self.has_cu_seqlens:
                raise ValueError(
                    f"has_cu_seqlens={self.has_cu_seqlens} but the batch "
                    f"{'has' if has else 'has no'} cu_seqlens: has_cu_seqlens is Megatron's "
                    "args.sft or args.dataloader_inter_document_masking, which must match the "
                    "dataset"
                )
            item = {k: item[k] for k in _MEGATRON_SENT if item.get(k) is not None}
            if not self.create_attention_mask:
                item.pop("attention_mask", None)  # Megatron sends no mask then: None everywhere
            elif not has and "attention_mask" not in item:
                raise ValueError(
                    "create_attention_mask_in_dataloader=True but the batch has no "
                    "attention_mask: pass --no-create-attention-mask-in-dataloader, or a dataset "
                    "that creates the mask"
                )
            tokens = item.get("tokens")
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else None
        else:
            return item  # the intake names what it got
        want = (self.micro_batch_size, self.seq_length)
        if got is not None and got != want:
            raise ValueError(
                f"batch['tokens'] has shape {got} but micro_batch_size={want[0]}, "
                f"seq_length={want[1]} (Megatron's --micro-batch-size, --seq-length; its other TP "
                "ranks allocate [micro_batch_size, seq_length]): pass the data's (a megapack "
                "PackedDataset's micro-batch is [1, rows_per_micro_batch * seq_len])"
            )
        return item


def _megatron(
    bound: Mapping[str, Any],
    *,
    topology: Topology | None,
    pg_collection: Any,
    timeout: float | None,
) -> dict[str, Any]:
    """Megatron-LM's form: its keywords checked against the topology, whole rows delivered."""
    flags = {
        name: _flag(name, bound.get(name, False))
        for name in ("has_cu_seqlens", "is_hybrid_cp", "create_attention_mask_in_dataloader",
                     "mtp_on_this_rank", "is_pipeline_first_stage", "is_pipeline_last_stage")
    }  # fmt: skip
    ints = {
        name: check_int(name, bound[name], minimum=minimum)
        for name, minimum in (("broadcast_src_rank", 0), ("cp_size", 1), ("tp_rank", 0),
                              ("micro_batch_size", 1), ("seq_length", 1))
    }  # fmt: skip
    pp_size = check_int(
        "pipeline_model_parallel_size", bound.get("pipeline_model_parallel_size", 1), minimum=1
    )
    if flags["is_hybrid_cp"]:
        raise ValueError(f"get_batch_on_this_tp_rank(is_hybrid_cp=True): {_HYBRID_CP}")
    if flags["has_cu_seqlens"] and flags["create_attention_mask_in_dataloader"]:
        raise ValueError(
            "get_batch_on_this_tp_rank(has_cu_seqlens=True, create_attention_mask_in_dataloader="
            "True): packed batches mask by document from cu_seqlens, never by a dense mask; pass "
            "--no-create-attention-mask-in-dataloader (Megatron's SFTDataset requires it too)"
        )
    full = _physical(_where(topology, pg_collection))
    group = bound["broadcast_group"]
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"broadcast_group must be a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else (_rank(),)
    checks = (
        (ranks == full.tp_ranks, f"broadcast_group holds ranks {ranks}", f"TP group is {full.tp_ranks}",
         "mpu.get_tensor_model_parallel_group()"),
        (ints["broadcast_src_rank"] == full.src_rank, f"broadcast_src_rank={ints['broadcast_src_rank']}",
         f"TP source (TP rank 0) is global rank {full.src_rank}", "mpu.get_tensor_model_parallel_src_rank()"),
        (ints["cp_size"] == full.cp_size, f"cp_size={ints['cp_size']}",
         f"CP group has {full.cp_size} ranks", "args.context_parallel_size"),
        (pp_size == full.pp_size, f"pipeline_model_parallel_size={pp_size}",
         f"pipeline has {full.pp_size} stages", "args.pipeline_model_parallel_size"),
        (pp_size == 1 or flags["is_pipeline_first_stage"] == (full.pp_rank == 0),
         f"is_pipeline_first_stage={flags['is_pipeline_first_stage']}",
         f"pipeline rank is {full.pp_rank}", "mpu.is_pipeline_first_stage()"),
        (pp_size == 1 or flags["is_pipeline_last_stage"] == (full.pp_rank == full.pp_size - 1),
         f"is_pipeline_last_stage={flags['is_pipeline_last_stage']}",
         f"pipeline rank is {full.pp_rank} of {full.pp_size}", "mpu.is_pipeline_last_stage()"),
    )  # fmt: skip
    given_where = topology is not None or pg_collection is not None
    told = "the topology given" if given_where else "megatron-core's parallel_state"
    for ok, given, actual, fix in checks:  # the same on every rank of the TP group
        if not ok:
            raise ValueError(
                f"get_batch_on_this_tp_rank: {given} but this rank's {actual} (per {told}): "
                f"pass {fix}"
            )
    mismatch = None  # this rank's own: raised after the frame arrived, so no TP rank waits
    if ints["tp_rank"] != full.tp_rank:
        mismatch = (
            f"get_batch_on_this_tp_rank: tp_rank={ints['tp_rank']} but global rank {_rank()} is "
            f"TP rank {full.tp_rank} of {full.tp_ranks}: pass mpu.get_tensor_model_parallel_rank()"
        )
    data = _MegatronData(
        has_cu_seqlens=flags["has_cu_seqlens"],
        create_attention_mask=flags["create_attention_mask_in_dataloader"],
        micro_batch_size=ints["micro_batch_size"],
        seq_length=ints["seq_length"],
    )
    topo = _whole_rows(full, mtp=flags["mtp_on_this_rank"])
    batch = bound["batch"]
    source = _Read(lambda: data.item(batch, refuse=mismatch)) if topo.is_source else None
    out = _deliver(source, topology=topo, timeout=timeout, packed=data.has_cu_seqlens)
    if mismatch is not None:
        raise ValueError(mismatch)
    return _megatron_dict(out)


def _megatron_pre_4103(
    data_iterator: Any,
    mtp_on_this_rank: bool,
    *,
    topology: Topology | None,
    pg_collection: Any,
    timeout: float | None,
) -> dict[str, Any]:
    """Megatron-LM's older form: the iterator, its dict in its own key order (cu_seqlens [1, n+1],
    max_seqlen [1]; cu_seqlens_padded 1-D, as pretrain_gpt then hands it to PackedSeqParams)."""
    topo = _whole_rows(_physical(_where(topology, pg_collection)), mtp=mtp_on_this_rank)

    def item(raw: Any) -> Any:
        if isinstance(raw, Mapping):
            if raw.get("local_cp_size") is not None:
                raise ValueError(f"the batch has local_cp_size, a hybrid-CP batch: {_HYBRID_CP}")
            return {k: raw[k] for k in _MEGATRON_SENT if raw.get(k) is not None}
        return raw  # a megapack.PackedBatch, or what the intake names

    source = None
    if topo.is_source and data_iterator is not None:
        source = _Read(lambda: item(next(data_iterator)))
    out = _deliver(source, topology=topo, timeout=timeout)
    new = _megatron_dict(out)
    return {
        "tokens": new["tokens"],
        "labels": new["labels"],
        "loss_mask": new["loss_mask"],
        "attention_mask": new["attention_mask"],
        "position_ids": new["position_ids"],
        "cu_seqlens": new["cu_seqlens"],
        "cu_seqlens_padded": out["cu_seqlens_padded"],
        "max_seqlen": new["max_seqlen"],
        "local_cp_size": None,
    }


def pretrain_gpt_get_batch(
    data_iterator: Iterator[Any] | None, vp_stage: int | None = None, *, args: Any = None
) -> list[Any]:
    """A whole replacement for Megatron-LM's ``pretrain_gpt.get_batch(data_iterator, vp_stage)``.

    Returns its ``BATCH_KEYS`` list (`MEGATRON_BATCH_KEYS` order: ``attention_mask``,
    ``cu_seqlens``, ..., ``tokens``) on every rank: the fields each stage needs, the rest None,
    this CP rank's share already taken (by megapack, per document for ``--sft``, per row for
    inter-document masking alone, as megatron-core's ``get_batch_on_this_cp_rank`` chooses),
    ``cu_seqlens`` [1, n+1] int32 on every stage, middle ones included, ``max_seqlen`` a [1]
    int32 CPU tensor. pretrain_gpt's ``forward_step`` runs unchanged on it.

    Only TP rank 0 reads ``data_iterator`` (Megatron builds it only there); its items may be
    Megatron's dicts (SFTDataset, GPTDataset) or megapack ``PackedBatch``es.

    Args:
        data_iterator: the iterator pretrain_gpt passes (None on other TP ranks).
        vp_stage: the model chunk's virtual pipeline stage, as pretrain_gpt passes it.
        args: Megatron-LM's arguments; default ``megatron.training.get_args()``. Read:
            ``sft``, ``dataloader_inter_document_masking``, ``create_attention_mask_in_dataloader``,
            ``hybrid_context_parallel``, ``micro_batch_size``, ``seq_length``,
            ``sequence_parallel``, ``mtp_num_layers``, ``pipeline_model_parallel_layout``.

    Raises:
        ValueError: ``--hybrid-context-parallel`` (megapack cannot honour it), a batch unlike what
            the arguments say (named), on the source; `RemoteDataError` on its peers.

    Example:
        In pretrain_gpt.py, after its ``def get_batch``::

            from megapack.megatron import pretrain_gpt_get_batch as get_batch
    """
    if args is None:
        from megatron.training import get_args  # Megatron-LM's, imported by pretrain_gpt.py

        args = get_args()
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError(
            f"pretrain_gpt_get_batch: args.hybrid_context_parallel is set: {_HYBRID_CP}"
        )
    sft, masking = bool(args.sft), bool(getattr(args, "dataloader_inter_document_masking", False))
    has_cu_seqlens = sft or masking
    topo = _from_parallel_state(vp_stage, cp_layout="row" if masking and not sft else "document")
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    topo = dataclasses.replace(
        topo, mtp=_mtp_here(getattr(args, "mtp_num_layers", None), layout, topo)
    )
    if topo.stage is Stage.MIDDLE and not has_cu_seqlens:
        return [None] * len(MEGATRON_BATCH_KEYS)  # Megatron builds no dataset there
    data = _MegatronData(
        has_cu_seqlens=has_cu_seqlens,
        create_attention_mask=bool(args.create_attention_mask_in_dataloader) and not has_cu_seqlens,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
    )
    source = None
    if topo.is_source and data_iterator is not None:
        source = _Read(lambda: data.item(next(data_iterator)))
    out = _deliver(
        source,
        topology=topo,
        packed=has_cu_seqlens,
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
    )
    batch = _megatron_dict(out)
    return [batch[key] for key in MEGATRON_BATCH_KEYS]


def _megatron_dict(out: Mapping[str, Any]) -> dict[str, Any]:
    """megapack's output as Megatron-LM's function returns it (its receivers' key order)."""

    def row(cu: torch.Tensor | None) -> torch.Tensor | None:
        return None if cu is None else cu.unsqueeze(0)

    max_seqlen = out["max_seqlen"]
    return {
        "tokens": out["tokens"],
        "labels": out["labels"],
        "loss_mask": out["loss_mask"],
        "position_ids": out["position_ids"],
        "attention_mask": out["attention_mask"],
        "cu_seqlens": row(out["cu_seqlens"]),
        "cu_seqlens_padded": row(out["cu_seqlens_padded"]),
        "max_seqlen": None if max_seqlen is None else torch.tensor([max_seqlen], dtype=torch.int32),
        "local_cp_size": None,
        "hybrid_cp_group": None,
    }


def _mtp_here(mtp_num_layers: int | None, layout: Any, topo: Topology) -> bool:
    """Megatron-LM's ``mtp_on_this_rank(layout, mtp_num_layers, ignore_virtual=False, vp_stage)``:
    without a layout, MTP layers sit on the last stage; with one (a string or megatron-core's
    ``PipelineParallelLayerLayout``), where it puts them."""
    if mtp_num_layers is None:
        return False
    if layout is None:
        return topo.is_last_stage
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )
    if isinstance(layout, str):
        layout = PipelineParallelLayerLayout.from_str(layout, topo.pp_size)
    chunks = layout.layout[topo.pp_rank]
    if topo.vp_stage is not None:
        chunks = [chunks[topo.vp_stage]]
    return any(chunk.count(LayerType.mtp) for chunk in chunks)


# -- Megatron-Bridge ---------------------------------------------------------------------------------
def _bridge_tp(
    bound: Mapping[str, Any], *, pg_collection: Any, timeout: float | None
) -> dict[str, Any]:
    """Bridge's ``batch_utils.get_batch_on_this_tp_rank``: whole rows, Bridge's keys."""
    cfg, use_mtp = bound["cfg"], _flag("use_mtp", bound.get("use_mtp", False))
    full = Topology.from_pg_collection(pg_collection)
    _check_bridge_pp(cfg, full)
    topo = _whole_rows(full, mtp=use_mtp and full.pp_rank == full.pp_size - 1)  # Bridge: last stage
    it = bound["data_iterator"]
    source = None
    if topo.is_source and it is not None:
        source = _Read(lambda: _bridge_item(next(it), keep_mask=True))
    out = _deliver(source, topology=topo, timeout=timeout, fields=(PADDING_MASK,))
    return _bridge_dict(out, topo)


def bridge_get_batch(
    data_iterator: Iterator[Any] | None,
    cfg: Any,
    use_mtp: bool = False,
    *,
    pg_collection: Any,
    vp_stage: int | None = None,
) -> tuple[Any, ...]:
    """A whole replacement for Megatron-Bridge's ``gpt_step.get_batch`` (same signature).

    Returns its 6-tuple ``(tokens, labels, loss_mask, attention_mask, position_ids,
    packed_seq_metadata)``: the fields this stage needs (others None), this CP rank's share
    taken by megapack (per document for packed rows, per row otherwise, as Bridge), and for a
    packed batch the metadata dict Bridge's forward step turns into ``PackedSeqParams``
    (``cu_seqlens_q``, ``cu_seqlens_kv``, their ``*_padded`` where the data has them, 1-D int32
    on every stage; ``max_seqlen_q``/``_kv`` [1] int32 CPU tensors; ``padding_mask`` where the
    data has one), else None. Bridge's item keys of either convention are read (``cu_seqlens_q``,
    ...; or ``cu_seqlens`` with ``-1`` sentinels, ``cu_seqlens_unpadded``, ``max_seqlen``);
    keys its forward step drops (``token_count``, ``total_tokens``, ...) are dropped.

    Only TP rank 0 reads its ``data_iterator`` (Bridge builds one on every TP rank: the others
    are left unread). Middle stages get the metadata and no tokens.

    Args:
        data_iterator: the iterator Bridge passes.
        cfg: Bridge's ``ConfigContainer``; read: ``cfg.model.pipeline_model_parallel_size``,
            ``virtual_pipeline_model_parallel_size`` and ``pipeline_model_parallel_layout``,
            ``cfg.dataset``'s packing and attention-mask settings (as Bridge's step reads them).
        use_mtp: whether the model has multi-token-prediction layers (on the last stage).
        pg_collection: the model's ``ProcessGroupCollection`` (`Topology.from_pg_collection`).
        vp_stage: the model chunk's virtual pipeline stage.

    Example:
        In a Bridge step module: ``from megapack.megatron import bridge_get_batch as get_batch``
        in place of ``from megatron.bridge.training.gpt_step import get_batch``.
    """
    model = getattr(cfg, "model", None)
    vp_size = getattr(model, "virtual_pipeline_model_parallel_size", None)
    chunked = vp_stage is not None and vp_size is not None
    topo = Topology.from_pg_collection(
        pg_collection, vp_stage=vp_stage if chunked else None, vp_size=vp_size if chunked else None
    )
    _check_bridge_pp(cfg, topo)
    layout = getattr(model, "pipeline_model_parallel_layout", None)
    if _flag("use_mtp", use_mtp) and _mtp_here(1, layout, topo):  # Bridge's rule, as Megatron's
        topo = dataclasses.replace(topo, mtp=True)
    if topo.stage is Stage.MIDDLE and not _bridge_middle_needs_batch(cfg):
        return None, None, None, None, None, None
    dataset = getattr(cfg, "dataset", None)
    keep_mask = not getattr(dataset, "skip_getting_attention_mask_from_dataset", True)
    source = None
    if topo.is_source and data_iterator is not None:
        source = _Read(lambda: _bridge_item(next(data_iterator), keep_mask=keep_mask))
    out = _deliver(source, topology=topo, fields=(PADDING_MASK,))
    batch = _bridge_dict(out, topo)
    metadata = None
    if batch["cu_seqlens_q"] is not None:
        metadata = {k: batch[k] for k in (*_BRIDGE_PACKED, "padding_mask") if batch[k] is not None}
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
            batch["position_ids"], metadata)  # fmt: skip


def _bridge_item(item: Any, *, keep_mask: bool) -> Any:
    """A Bridge dataset item as megapack's intake takes it (module docstring; run on the source)."""
    if isinstance(item, PackedBatch) and PADDING_MASK.name not in item.extras:
        return dataclasses.replace(
            item, extras={**item.extras, PADDING_MASK.name: torch.zeros(0, dtype=torch.uint8)}
        )
    if not isinstance(item, Mapping):
        return item  # a PackedBatch with its padding mask, or what the intake names
    out = {k: item[k] for k in ("tokens", "labels", "loss_mask", "position_ids") if k in item}
    if keep_mask and item.get("attention_mask") is not None:
        out["attention_mask"] = item["attention_mask"]
    mask = torch.zeros(0, dtype=torch.uint8)
    if item.get("cu_seqlens_q") is not None:
        for q, kv in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"),
                      ("max_seqlen_q", "max_seqlen_kv")):  # fmt: skip
            a, b = item.get(q), item.get(kv)
            if (
                b is not None
                and b is not a
                and (a is None or not torch.equal(torch.as_tensor(a), torch.as_tensor(b)))
            ):
                raise ValueError(
                    f"batch[{kv!r}] differs from batch[{q!r}]: megapack delivers one set of "
                    "boundaries, for self-attention (queries and keys alike)"
                )
        real, padded = _fold_empty_tail(item["cu_seqlens_q"], item.get("cu_seqlens_q_padded"))
        out |= {
            "cu_seqlens": real,
            "cu_seqlens_padded": padded,
            "max_seqlen": item.get("max_seqlen_q"),
        }
        if item.get("padding_mask") is not None:
            given, tokens = item["padding_mask"], item.get("tokens")
            if isinstance(tokens, torch.Tensor) and tuple(given.shape) != tuple(tokens.shape):
                raise ValueError(
                    f"batch['padding_mask'] has shape {tuple(given.shape)} but tokens has "
                    f"{tuple(tokens.shape)}: one flag per token"
                )
            mask = given.reshape(-1).to(torch.uint8)
    elif item.get("cu_seqlens") is not None:  # Bridge's legacy keys: cu_seqlens are the buffer's
        unpadded = item.get("cu_seqlens_unpadded")
        out |= {
            "cu_seqlens": item["cu_seqlens"] if unpadded is None else unpadded,
            "cu_seqlens_padded": None if unpadded is None else item["cu_seqlens"],
            "max_seqlen": item.get("max_seqlen"),
        }
    out["padding_mask"] = mask
    return {k: v for k, v in out.items() if v is not None}


def _fold_empty_tail(
    real: torch.Tensor, padded: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bridge's packed rows with megapack's boundaries: a trailing segment of padding only (a
    repeated real boundary, as Bridge's packer and its static ``pad_cu_seqlens`` add) joins the
    padding of the segment before it; other rows end with ``-1`` sentinels.

    Example, s=16: padded ``[0, 4, 8, 16, 16]``, real ``[0, 3, 7, 7, 7]`` -> padded
    ``[0, 4, 16]``, real ``[0, 3, 7]`` (the second document's buffer runs to 16).
    """
    if padded is None:
        return real, None
    real_rows = real.reshape(-1, real.shape[-1]).tolist()
    padded_rows = padded.reshape(-1, padded.shape[-1]).tolist()
    if len(real_rows) != len(padded_rows):
        raise ValueError(
            f"cu_seqlens_q has {len(real_rows)} rows but cu_seqlens_q_padded {len(padded_rows)}"
        )
    new_real, new_padded = [], []
    for r, p in zip(real_rows, padded_rows, strict=True):
        end = p.index(max(p)) + 1  # the buffer's last boundary, then its repeats
        p, r = p[:end], r[:end]
        while len(r) > 2 and r[-1] == r[-2]:
            r, p = r[:-1], [*p[:-2], p[-1]]
        new_real.append(r)
        new_padded.append(p)
    width = max(len(p) for p in new_padded)

    def table(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int32)

    return table(new_real), table(new_padded)


def _bridge_dict(out: Mapping[str, Any], topo: Topology) -> dict[str, Any]:
    """megapack's output with Bridge's keys (``cu_seqlens_q``, ...; ``padding_mask`` [1, T] bool,
    this CP rank's share of it, or None)."""
    cu, padded, max_seqlen = out["cu_seqlens"], out["cu_seqlens_padded"], out["max_seqlen"]
    mask = out["padding_mask"]
    if mask is not None and mask.numel() and cu is not None:
        if topo.cp_size > 1:  # the share of the per-token fields, taken the same way
            buffer = padded if padded is not None else cu
            mask = mask[cp_indices(buffer, topo.cp_size, topo.cp_rank, layout=topo.cp_layout,
                                   total=mask.numel())]  # fmt: skip
        mask = mask.view(1, -1).bool()
    else:
        mask = None
    seqlen = None if max_seqlen is None else torch.tensor([max_seqlen], dtype=torch.int32)
    return {
        "tokens": out["tokens"],
        "labels": out["labels"],
        "loss_mask": out["loss_mask"],
        "attention_mask": out["attention_mask"],
        "position_ids": out["position_ids"],
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": padded,
        "cu_seqlens_kv_padded": padded,
        "max_seqlen_q": seqlen,
        "max_seqlen_kv": seqlen,
        "padding_mask": mask,
    }


def _check_bridge_pp(cfg: Any, topo: Topology) -> None:
    size = getattr(getattr(cfg, "model", None), "pipeline_model_parallel_size", None)
    if size is not None and size != topo.pp_size:
        raise ValueError(
            f"cfg.model.pipeline_model_parallel_size={size} but pg_collection.pp has "
            f"{topo.pp_size} ranks: pass the model's pg_collection (get_pg_collection(model))"
        )


def _bridge_middle_needs_batch(cfg: Any) -> bool:
    """Bridge's ``_middle_pp_stage_needs_batch``: a custom attention mask or packed metadata."""
    dataset = getattr(cfg, "dataset", None)
    if not getattr(dataset, "skip_getting_attention_mask_from_dataset", True):
        return True
    if getattr(dataset, "enable_offline_packing", False):
        specs = getattr(dataset, "offline_packing_specs", None)
        size = getattr(specs, "packed_sequence_size", None)
        return size is None or size > 0
    return bool(getattr(dataset, "enable_in_batch_packing", False))


# -- shared -----------------------------------------------------------------------------------------
class _Read(Iterator[Any]):
    """The TP source's item, made inside the delivery's ``next()``: whatever fails there (the
    caller's iterator, a caller's check) is the source's error and its peers' RemoteDataError."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read = read

    def __next__(self) -> Any:
        return self._read()


def _deliver(source: Iterator[Any] | None, **options: Any) -> dict[str, Any]:
    return deliver(source, **options)


def _where(topology: Topology | None, pg_collection: Any) -> Topology:
    topo = resolve_topology(topology, pg_collection)
    return topo if topo is not None else _from_parallel_state(None)


def _from_parallel_state(vp_stage: int | None, *, cp_layout: Any = "document") -> Topology:
    """megatron-core's ``parallel_state`` topology; with virtual pipelining and no ``vp_stage``,
    chunk 0's (callers of Megatron's function mean the physical stage: `_physical`)."""
    from megapack.core.quiet import quiet_megatron

    with quiet_megatron():
        from megatron.core import parallel_state as ps

    if vp_stage is None and ps.model_parallel_is_initialized():
        vp_stage = 0 if ps.get_virtual_pipeline_model_parallel_world_size() is not None else None
    return Topology.from_parallel_state(vp_stage=vp_stage, cp_layout=cp_layout)


def _physical(topo: Topology) -> Topology:
    """The physical pipeline stage, as Megatron's functions decide what to send (no chunks)."""
    if topo.vp_size is None:
        return topo
    return dataclasses.replace(topo, vp_stage=None, vp_size=None)


def _whole_rows(topo: Topology, *, mtp: bool) -> Topology:
    """``topo`` without its CP group (the caller splits rows after the call), with ``mtp``."""
    return dataclasses.replace(topo, cp_group=None, cp_ranks=(), cp_rank=0, mtp=mtp)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def _is_default(name: str, value: Any) -> bool:
    default = _defaults()[name]
    if name == "fields":
        return not tuple(value)
    return value is default or (type(value) is type(default) and value == default)


@functools.cache
def _defaults() -> dict[str, Any]:
    """megapack's own keywords' defaults, from `deliver`'s signature."""
    params = inspect.signature(deliver).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
