"""Every field a batch carries, as data: one `BatchField` declaration each, built in or a trainer's own.

A declaration says what a field is *per*, its dtype and which pipeline stages get it; everything
else follows from those: how the TP source checks it (`megapack.core.intake`), how a CP rank takes
its share (`share`), where it sits in a frame and in the header (`megapack.delivery.wire`).

    per        shape in a THD batch          a CP rank keeps                  e.g.
    ---------  ----------------------------  -------------------------------  -----------------------
    token      [1, T]  ([b, s] plain rows)   its zigzag positions (dim 1)     tokens, labels, advantages
    mask       [b, 1, s, s]                  its query positions (dim 2)      attention_mask
    boundary   [n + 1]                       all of it                        cu_seqlens
    sample     [b, ...]                      all of it                        dataset_id, rewards
    ragged     [sum n_i, ...]                all of it                        pixel_values
    scalar     a Python int                  all of it                        max_seqlen

Stages: "first" is the embedding's stage, "last" the loss's, "all" every stage. The only stage of
pp=1 (`Stage.ONLY`) gets every field; a stage with multi-token-prediction layers (`Stage.MTP`)
gets what first and last get.

A trainer's per-token field also says where its values sit (``at``, no default): ``"token"``,
value i belongs to input token i, as a rollout gives log-probs (one per generated token);
`PackedBatch.from_documents` shifts it to the label that predicts that token, as it shifts
``loss_mask`` (placed ``value[i + 1]`` at position i); or ``"label"``, value i already pairs with
``labels[i]`` (placed as given). In a batch, a trainer's per-token field sits at the labels
(value j pairs with ``labels[j]``), as ``loss_mask`` does. A Megatron dict's fields travel as
given, so a dict takes ``at="label"`` (`megapack.core.intake` refuses ``"token"`` there).

    tokens of a document   a    b    c    d            labels  b    c    d    P
    old_logprobs given     -    lb   lc   ld           at="token" -> [lb, lc, ld, 0]
                                                       at="label" -> as given

Example, a GRPO trainer's per-token log-probs from its rollout, for the loss:

    >>> BatchField("old_logprobs", "token", torch.float32, "last", at="token")
    BatchField(name='old_logprobs', per='token', dtype=torch.float32, stages='last', at='token')
"""

from __future__ import annotations

import enum
import functools
import hashlib
import keyword
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

Per = Literal["token", "mask", "boundary", "sample", "ragged", "scalar"]
StageSet = Literal["first", "last", "all"]
At = Literal["token", "label"]
AT_KINDS: tuple[str, ...] = ("token", "label")
"""Where a trainer's per-token values sit: at their input tokens, or already at the labels."""
PLACED_BY_MEGAPACK = frozenset({"tokens", "position_ids", "labels", "loss_mask"})
"""The built-in per-token fields, which megapack places itself (they take no ``at``)."""
PER_KINDS: tuple[str, ...] = ("token", "mask", "boundary", "sample", "ragged", "scalar")
TRAINER_KINDS: tuple[str, ...] = ("token", "sample", "ragged")
"""What a trainer's own field may be per; the other kinds are the built-in fields' alone."""
STAGE_SETS: tuple[str, ...] = ("first", "last", "all")
MAX_DIMS = 6
"""Most dimensions a field's tensor may have (the header holds this many per field)."""


class Stage(enum.Enum):
    """The role of a pipeline stage, which decides the fields it receives."""

    ONLY = "only"
    FIRST = "first"
    MIDDLE = "middle"
    LAST = "last"
    MTP = "mtp"


_STAGES: dict[str, frozenset[Stage]] = {
    "first": frozenset({Stage.ONLY, Stage.FIRST, Stage.MTP}),  # the embedding (MTP layers embed)
    "last": frozenset({Stage.ONLY, Stage.LAST, Stage.MTP}),  # the loss
    "all": frozenset(Stage),
}


@dataclass(frozen=True, slots=True)
class BatchField:
    """One field of a batch: its name, what it is per, its dtype and the stages that get it.

    Args:
        name: the key in the iterator's dict (or in ``PackedBatch.extras``) and in the returned
            dict; a Python identifier.
        per: "token" ([b, s] in a Megatron dict like labels, [1, T] in a PackedBatch), "sample"
            ([b, ...], one entry per sample of the micro-batch) or "ragged" (a list of b tensors
            [n_i, ...], or one tensor [sum n_i, ...]); the built-in fields also use "mask",
            "boundary" and "scalar".
        dtype: a float or integer torch dtype; values arrive bit-exact.
        stages: "first" (the embedding's stage), "last" (the loss's) or "all".
        at: a per-token field's alignment, required (no default: a silent one would move
            values): "token" (value i belongs to input token i; `PackedBatch.from_documents`
            shifts it to the label position, as ``loss_mask``) or "label" (value i pairs with
            ``labels[i]`` already; placed as given). Not given for other kinds.
    """

    name: str
    per: Per
    dtype: torch.dtype
    stages: StageSet
    at: At | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.name, str)
            or not self.name.isidentifier()
            or keyword.iskeyword(self.name)
        ):
            raise ValueError(f"BatchField name must be a Python identifier, got {self.name!r}")
        if self.per not in PER_KINDS:
            raise ValueError(
                f"BatchField {self.name!r}: per={self.per!r}; expected one of {TRAINER_KINDS}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"BatchField {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}"
            )
        if self.dtype.is_complex or (self.dtype == torch.bool and self.per != "mask"):
            raise ValueError(
                f"BatchField {self.name!r}: dtype={self.dtype}; expected a float or integer dtype"
            )
        if self.stages not in STAGE_SETS:
            raise ValueError(
                f"BatchField {self.name!r}: stages={self.stages!r}; expected one of {STAGE_SETS}"
            )
        self._check_at()

    def _check_at(self) -> None:
        """A trainer's per-token field names its alignment; no other field takes one."""
        if self.at is not None and not isinstance(self.at, str):
            raise TypeError(
                f"BatchField {self.name!r}: at must be 'token' or 'label', got "
                f"{type(self.at).__name__} {self.at!r}"
            )
        if self.at is not None and self.at not in AT_KINDS:
            raise ValueError(
                f"BatchField {self.name!r}: at={self.at!r}; expected 'token' or 'label'"
            )
        if self.per != "token" and self.at is not None:
            raise ValueError(
                f"BatchField {self.name!r}: at={self.at!r} is for per-token fields; a "
                f"per={self.per!r} field has no label alignment: drop at="
            )
        if self.per == "token" and self.at is None and self.name not in PLACED_BY_MEGAPACK:
            raise ValueError(
                f"BatchField {self.name!r}: a per-token field needs at=: 'token' when value i "
                "belongs to input token i (a rollout's log-probs, one per token: megapack shifts "
                "it to the label that predicts the token, as it shifts loss_mask) or 'label' when "
                "value i already pairs with labels[i] (placed as given)"
            )

    @property
    def stage_set(self) -> frozenset[Stage]:
        """The pipeline stages (`Stage`) that receive this field."""
        return _STAGES[self.stages]

    @property
    def share(self) -> Literal["positions", "queries", "whole"]:
        """How a CP rank takes its share: its token positions (dim 1), its query rows of a mask
        (dim 2), or the whole field (boundaries, per-sample and ragged fields, scalars)."""
        return "positions" if self.per == "token" else "queries" if self.per == "mask" else "whole"

    @property
    def is_tensor(self) -> bool:
        """False for scalars, which travel in the header as Python ints."""
        return self.per != "scalar"


BUILTIN_FIELDS: tuple[BatchField, ...] = (
    BatchField("tokens", "token", torch.int64, "first"),
    BatchField("position_ids", "token", torch.int64, "first"),
    BatchField("labels", "token", torch.int64, "last"),
    BatchField("loss_mask", "token", torch.float32, "last"),
    BatchField("attention_mask", "mask", torch.bool, "all"),  # [b, 1, s_q, s_kv] (plain rows)
    BatchField("cu_seqlens", "boundary", torch.int32, "all"),
    BatchField("cu_seqlens_padded", "boundary", torch.int32, "all"),
    BatchField("dataset_id", "sample", torch.int64, "all"),  # BlendedDataset's source per sample
    BatchField("max_seqlen", "scalar", torch.int64, "all"),  # longest buffer segment
    BatchField("local_cp_size", "scalar", torch.int64, "all"),  # Megatron's hybrid CP group size
)
"""The fields megapack knows without being told, in frame order."""
BUILTIN_NAMES = frozenset(f.name for f in BUILTIN_FIELDS)
OUTPUT_KEYS: tuple[str, ...] = (*(f.name for f in BUILTIN_FIELDS), "packed_seq_params")
"""The keys of every dict `get_batch_on_this_tp_rank` returns (plus the trainer's declared names)."""
GRID_NAMES = ("tokens", "labels", "loss_mask", "position_ids")
"""The per-token built-in fields of a Megatron dict, [b, s] each (THD [1, T] once packed)."""
TOKEN_DTYPE = torch.int64
MASK_DTYPE = torch.float32
CU_DTYPE = torch.int32


@dataclass(frozen=True, eq=False, slots=True)
class Schema:
    """The built-in fields followed by a trainer's declared ones: what one call carries.

    Every TP rank of a group builds the same schema from the same ``fields=``; ``key`` (a stable
    63-bit hash of the declarations, a per-token field's ``at`` included) lets the ranks check
    that they did.
    """

    fields: tuple[BatchField, ...]
    declared: tuple[BatchField, ...]
    key: int
    by_stage: dict[Stage, tuple[BatchField, ...]]
    """The fields each stage receives, in frame order."""
    names: tuple[str, ...]
    """Every field's name, in frame order."""
    output_keys: tuple[str, ...]
    """The keys of the dict a call returns: `OUTPUT_KEYS` and the declared names."""


def schema_of(declared: Iterable[BatchField] = ()) -> Schema:
    """The `Schema` for a trainer's declared fields (cached: one per distinct declaration).

    Raises:
        TypeError: an entry is not a `BatchField`.
        ValueError: a name collides with a built-in field or another declaration, or a field is
            per "mask", "boundary" or "scalar" (kinds only the built-in fields use).
    """
    fields = tuple(declared)
    for f in fields:
        if not isinstance(f, BatchField):
            raise TypeError(
                f"fields= takes megapack.BatchField declarations, got {type(f).__name__} {f!r}"
            )
    return _schema(fields)


@functools.lru_cache(maxsize=64)
def _schema(declared: tuple[BatchField, ...]) -> Schema:
    seen: set[str] = set()
    for f in declared:
        if f.name in BUILTIN_NAMES or f.name == "packed_seq_params":
            raise ValueError(
                f"BatchField {f.name!r} collides with a built-in output of the same name "
                f"({sorted({*BUILTIN_NAMES, 'packed_seq_params'})}): rename it"
            )
        if f.name in seen:
            raise ValueError(f"fields= declares {f.name!r} twice")
        if f.per not in TRAINER_KINDS:
            raise ValueError(
                f"BatchField {f.name!r}: per={f.per!r} is for megapack's built-in fields; "
                f"a trainer's field is per one of {TRAINER_KINDS}"
            )
        seen.add(f.name)
    fields = (*BUILTIN_FIELDS, *declared)
    text = ";".join(f"{f.name}:{f.per}:{f.dtype}:{f.stages}{_at(f)}" for f in fields)
    key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
    by_stage = {s: tuple(f for f in fields if s in f.stage_set) for s in Stage}
    return Schema(
        fields=fields,
        declared=declared,
        key=key,
        by_stage=by_stage,
        names=tuple(f.name for f in fields),
        output_keys=(*OUTPUT_KEYS, *(f.name for f in declared)),
    )


def _at(field: BatchField) -> str:
    """A declaration's alignment as the schema key reads it (part of what TP ranks compare)."""
    return "" if field.at is None else f":at={field.at}"
