"""`PackOptions` and `LoadOptions`: every setting of packing and of loading, each defined once.

The settings split by when they apply:

    PackOptions  what packing decides: the rows themselves (row length, padding, algorithm, policy
                 for long documents, documents a row, seed, search budget). A packed folder records
                 them in its ``meta.json`` (``"packing"``) and `PackedDataset.load` reads them back:
                 a folder says how it was packed, and cannot be loaded as something else.
    LoadOptions  what loading decides: how the rows are dealt and served (rows a micro-batch,
                 micro-batches a step, DP rank and size, balance and its cost model, loss fields,
                 pad id). It may change between runs of one folder (a DP-size change on resume).

`megapack.packing.plan`, `StreamingPacker`, `PackWriter`, `PackedDataset` and ``megapack pack`` /
``stats`` take these objects and read their settings from them; each setting has its one default
and its one check here, in the class. An object is validated once, when it is made: a wrong type is
a TypeError, a bad value a ValueError, each naming the field and the value. Options are frozen;
``dataclasses.replace(options, seed=1)`` makes a changed copy (checked again).

Keyword shortcuts: `PackedDataset(...)` and `plan(...)` take the fields of `PackOptions`, and
`PackedDataset(...)` and `PackedDataset.load(...)` those of `LoadOptions`, as keywords
(``PackedDataset.load("packed/", rows_per_micro_batch=2, dp_rank=r, dp_size=8)``): each builds
the options object (`with_shortcuts`), so a shortcut has the field's default and check and no
other. Adding an option is one field here, plus the code that uses it.

Example:
    >>> p = PackOptions(seq_len=4096, pad_to_multiple_of=8, cp_size=2)
    >>> p.multiple  # documents are padded to lcm(8, 2 x cp_size)
    8
    >>> PackOptions.from_dict(p.to_dict()) == p
    True
    >>> LoadOptions(dp_rank=3, dp_size=2)
    Traceback (most recent call last):
    ValueError: dp_rank=3 is outside dp_size=2 (0 <= dp_rank < dp_size)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from megapack.core.checks import check_int
from megapack.core.cp_pad import cp_pad_multiple
from megapack.packing.cost import CostModel
from megapack.packing.names import ALGORITHMS, BALANCE_MODES, LONG_DOC_POLICIES

DEFAULT_SEARCH_STEPS = 20_000
"""`PackOptions.search_steps`' default: about 6 s of "best" search on OpenChat V1 (2-core CPU)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackOptions:
    """What packing decides: the rows. Recorded in a packed folder (``meta.json``'s "packing").

    Example, lengths ``[3, 5]`` at ``seq_len=8, pad_to_multiple_of=2``: planned as ``[4, 6]``
    (``multiple`` 2), so two rows; 2 slots of alignment padding.
    """

    seq_len: int
    """Tokens a row (the packed sequence length, the word used everywhere for it): a multiple of
    `multiple`."""
    algorithm: str = ALGORITHMS[0]
    """Bin-packing algorithm, one of `megapack.packing.names.ALGORITHMS`: "bfd" (best-fit
    decreasing), "ffd", "first_fit", "next_fit" or "best" (a search from bfd that never uses more
    rows; see `search_steps`)."""
    long_docs: str = LONG_DOC_POLICIES[0]
    """Documents longer than ``seq_len``: "split" (pieces of at most ``seq_len`` tokens; a
    `PackedDataset` or ``megapack pack`` cuts chats at message boundaries), "truncate" (the first
    ``seq_len`` tokens), "drop", or "error" (a ValueError naming the first)."""
    pad_to_multiple_of: int = 1
    """Pad every document (piece) to a multiple of this in its row (e.g. 8/16 for FP8 kernels)."""
    cp_size: int = 1
    """Context-parallel size the rows are for: documents are padded to multiples of ``2 x cp_size``
    too, as the "document" CP layout needs (`multiple`)."""
    max_documents: int | None = None
    """At most this many documents (or pieces) a row, for static shapes a CUDA graph replays
    (`megapack.core.static`); None: no cap. ``megapack stats`` suggests one."""
    seed: int = 0
    """Seeds the "best" search and, when loading, every epoch's shuffle of the rows."""
    search_steps: int = DEFAULT_SEARCH_STEPS
    """The "best" search's budget: at most this many search steps for each plan made (`plan`:
    the whole input; a `StreamingPacker`: each buffer it plans). Steps, not seconds, so the same
    options give the same rows on every machine. About 3,300 steps a second on the OpenChat V1
    lengths (6,144 documents, seq_len 2,048; 2-core CPU): the default stops after about 6 s unless
    the rows reach the lower bound first (1,000,000 lognormal lengths: 2.8 s). 0: "best" is "bfd".
    Other algorithms ignore it."""

    def __post_init__(self) -> None:
        for name, least in (("seq_len", 1), ("pad_to_multiple_of", 1), ("cp_size", 1)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=least))
        for name, least in (("seed", 0), ("search_steps", 0)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=least))
        if self.max_documents is not None:
            cap = check_int("max_documents", self.max_documents, minimum=1)
            object.__setattr__(self, "max_documents", cap)
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        check_choice("long_docs", self.long_docs, LONG_DOC_POLICIES)
        if self.seq_len % self.multiple:
            why = (
                f"pad_to_multiple_of={self.multiple}"
                if self.cp_size == 1
                else f"{self.multiple} (pad_to_multiple_of={self.pad_to_multiple_of}, "
                f"cp_size={self.cp_size}: lcm(pad_to_multiple_of, 2 * cp_size))"
            )
            raise ValueError(f"seq_len={self.seq_len} must be a multiple of {why}")

    @property
    def multiple(self) -> int:
        """The multiple every document is padded to: ``pad_to_multiple_of``, or its lcm with
        ``2 * cp_size`` (`megapack.core.cp_pad.cp_pad_multiple`)."""
        return cp_pad_multiple(self.cp_size, self.pad_to_multiple_of)

    def to_dict(self) -> dict[str, Any]:
        """The options as plain JSON values (what ``meta.json`` records)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: Any, *, where: str = "packing options") -> PackOptions:
        """Options from `to_dict`'s dict (e.g. a folder's ``meta.json``), checked.

        Raises:
            TypeError: not a dict.
            ValueError: a key that is not an option (naming it and ``where``), or a bad value.
        """
        if not isinstance(values, dict):
            raise TypeError(f"{where} must be a dict of PackOptions fields, got {values!r}")
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"{where} has {', '.join(map(repr, unknown))}, which PackOptions does not know "
                "(written by a later megapack?)"
            )
        return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadOptions:
    """What loading decides: how a packed folder's rows are dealt and served. May change between
    runs of one folder (a DP-size change on resume keeps ``dp_size x micro_batches``).

    Rows are dealt in whole optimizer steps: micro-batch ``j`` of an epoch holds
    ``rows_per_micro_batch`` rows and goes to DP rank ``j % dp_size``; a step (global batch) is
    ``dp_size x micro_batches`` micro-batches (`megapack.packing.balance`). Example:
    ``LoadOptions(rows_per_micro_batch=2, micro_batches=4, dp_rank=1, dp_size=8)`` serves DP rank 1
    micro-batches of 2 rows, 4 a step; a step is 64 rows (`rows_per_step`).
    """

    rows_per_micro_batch: int = 1
    """Rows concatenated into one THD micro-batch ``[1, rows x seq_len]`` (run Megatron with
    ``--micro-batch-size 1`` and ``seq_length = rows_per_micro_batch x seq_len``)."""
    micro_batches: int = 1
    """Micro-batches per DP rank per optimizer step (Megatron's ``num_microbatches``); an epoch is
    padded with zero-loss micro-batches to whole steps."""
    dp_rank: int = 0
    """This rank's data-parallel rank, ``0 <= dp_rank < dp_size``."""
    dp_size: int = 1
    """Data-parallel ranks: each gets the same number of micro-batches."""
    balance: str = BALANCE_MODES[0]
    """How rows are dealt to the DP ranks (`megapack.packing.names.BALANCE_MODES`): "token" (a
    seeded shuffle, dealt round-robin) or "compute" (each step's rows dealt so every rank's step
    costs about the same under ``cost``; `megapack.packing.balance`)."""
    cost: CostModel | None = None
    """What a row costs to train (`CostModel`), required by ``balance="compute"``."""
    loss_fields: bool = False
    """Attach each step's loss fields (`megapack.core.loss_fields.LOSS_FIELDS`) to every
    micro-batch, for `megapack.megatron.normalized_loss`'s step modes; ``micro_batches`` and
    ``dp_size`` must then be the trainer's."""
    split_documents: str = "whole"
    """With ``loss_fields``: the pieces of a split document in one step count as one document
    ("whole") or each as its own ("pieces"); `megapack.core.loss_fields.SPLIT_READINGS`."""
    pad_token_id: int | None = None
    """Id of padding tokens and of labels with no next token; None: the folder's recorded one (the
    packer's tokenizer's; 0 where it knew none)."""

    def __post_init__(self) -> None:
        for name in ("rows_per_micro_batch", "micro_batches", "dp_size"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        object.__setattr__(self, "dp_rank", check_int("dp_rank", self.dp_rank, minimum=0))
        if self.dp_rank >= self.dp_size:
            raise ValueError(
                f"dp_rank={self.dp_rank} is outside dp_size={self.dp_size} (0 <= dp_rank < dp_size)"
            )
        check_choice("balance", self.balance, BALANCE_MODES)
        if self.cost is not None and not isinstance(self.cost, CostModel):
            raise TypeError(f"cost must be a CostModel or None, got {type(self.cost).__name__}")
        if self.balance == "compute" and self.cost is None:
            raise TypeError(
                "balance='compute' needs cost=CostModel(...), got None; e.g. "
                "CostModel.from_shape(hidden=..., ffn=..., layers=..., heads=..., vocab=...)"
            )
        if not isinstance(self.loss_fields, bool):
            raise TypeError(f"loss_fields must be True or False, got {self.loss_fields!r}")
        if self.split_documents != "whole":  # the list's home imports torch: only when needed
            from megapack.core.loss_fields import check_reading

            check_reading(self.split_documents)
        if self.pad_token_id is not None:
            pad = check_int("pad_token_id", self.pad_token_id, minimum=0)
            object.__setattr__(self, "pad_token_id", pad)

    @property
    def rows_per_step(self) -> int:
        """Rows of one optimizer step over every DP rank: ``dp_size x micro_batches x
        rows_per_micro_batch`` (a global batch)."""
        return self.dp_size * self.micro_batches * self.rows_per_micro_batch


Options = TypeVar("Options", PackOptions, LoadOptions)


def with_shortcuts(
    kind: type[Options], given: Options | None, shortcuts: dict[str, Any], *, where: str
) -> Options:
    """``given`` (default: ``kind()``'s defaults) with the keyword shortcuts of ``kind``'s fields
    set; the result is checked as any options object.

    Raises:
        TypeError: a shortcut that is no field of ``kind`` (naming it, ``where`` and the fields),
            or ``given`` is not a ``kind``.

    Example:
        >>> with_shortcuts(LoadOptions, None, {"dp_size": 2}, where="load").dp_size
        2
    """
    names = [f.name for f in dataclasses.fields(kind)]
    unknown = sorted(set(shortcuts) - set(names))
    if unknown:
        raise TypeError(
            f"{where} got an unexpected keyword argument {unknown[0]!r}; its {kind.__name__} "
            f"shortcuts are {', '.join(names)}"
        )
    if given is None:
        return kind(**shortcuts)
    if not isinstance(given, kind):
        raise TypeError(f"{where}: expected {kind.__name__}, got {type(given).__name__} {given!r}")
    return dataclasses.replace(given, **shortcuts) if shortcuts else given


def split_shortcuts(
    shortcuts: dict[str, Any], *, where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword shortcuts split into `PackOptions`' and `LoadOptions`' (no name is both's).

    Raises:
        TypeError: a keyword that is neither's field, naming it, ``where`` and both field lists.
    """
    pack = [f.name for f in dataclasses.fields(PackOptions)]
    load = [f.name for f in dataclasses.fields(LoadOptions)]
    unknown = sorted(set(shortcuts) - set(pack) - set(load))
    if unknown:
        raise TypeError(
            f"{where} got an unexpected keyword argument {unknown[0]!r}; its shortcuts are the "
            f"fields of PackOptions ({', '.join(pack)}) and LoadOptions ({', '.join(load)})"
        )
    return (
        {k: v for k, v in shortcuts.items() if k in pack},
        {k: v for k, v in shortcuts.items() if k in load},
    )


def pack_options(
    packing: PackOptions | int | None, shortcuts: dict[str, Any], *, where: str
) -> PackOptions:
    """`PackOptions` from a ``packing`` argument: the options, or their ``seq_len`` alone (an
    int), with keyword shortcuts of its fields set.

    Raises:
        TypeError: ``packing`` is neither (naming it as ``seq_len``), no ``seq_len`` at all, or
            it twice, or a bad shortcut.
        ValueError: a bad value.
    """
    if packing is None or isinstance(packing, PackOptions):
        if packing is None and "seq_len" not in shortcuts:
            raise TypeError(f"{where} needs seq_len (or packing=PackOptions(seq_len=...))")
        return with_shortcuts(PackOptions, packing, shortcuts, where=where)
    if "seq_len" in shortcuts:
        raise TypeError(
            f"{where} got seq_len twice: {packing!r} and seq_len={shortcuts['seq_len']!r}"
        )
    return with_shortcuts(PackOptions, None, {"seq_len": packing, **shortcuts}, where=where)


def default_of(kind: type[PackOptions] | type[LoadOptions], name: str) -> Any:
    """The default of field ``name`` of ``kind`` (e.g. for a command-line flag's default).

    Example:
        >>> default_of(PackOptions, "algorithm"), default_of(LoadOptions, "balance")
        ('bfd', 'token')
    """
    return next(f.default for f in dataclasses.fields(kind) if f.name == name)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; TypeError unless a str, ValueError naming the choices.

    Example:
        >>> check_choice("balance", "token", ("token", "compute"))
        'token'
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value
