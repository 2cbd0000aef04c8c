"""Where this rank sits in the tensor-, pipeline- and context-parallel grid, as one frozen object.

megapack keeps no module-level process groups: build a `Topology` once, from megatron-core's
``parallel_state`` (`Topology.from_parallel_state`), from the ``ProcessGroupCollection`` that
megatron-core and Megatron-Bridge pass around instead (`Topology.from_pg_collection`), or from
groups a script manages itself (`Topology.from_groups`), and pass it to the functions that
communicate. A function that takes either a ``topology=`` or a ``pg_collection=`` turns them into
one with `resolve_topology`.

Pipeline stages (``Stage``), for ``pp_size`` stages and optional virtual chunks:

    pp_size == 1                          -> ONLY   (holds embedding and loss)
    pp_rank == 0 and first virtual chunk  -> FIRST  (embedding: needs tokens, position_ids)
    last pp_rank and last virtual chunk   -> LAST   (loss: needs labels, loss_mask)
    anything else                         -> MIDDLE (only attention metadata)
    ``mtp=True`` and not ONLY              -> MTP    (multi-token-prediction layers on this stage,
                                                     usually the last: embedding and loss both)

Context parallelism (``cp_size > 1``) is orthogonal to the stage: each CP rank's TP group has its
own TP source, which reads the same full row and keeps its CP share (`megapack.core.cp_share`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megapack.core.cp_share import CP_LAYOUTS, CpLayout
from megapack.core.fields import Stage


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """One rank's place in the tp x pp grid.

    Example, tp=2 x pp=2 on 4 ranks with Megatron's default order (tp fastest): global rank 3 has
    ``tp_ranks=(2, 3)``, ``tp_rank=1``, ``pp_rank=1``, ``pp_size=2``; it is a receiver on the LAST
    stage and its TP source is global rank 2.
    """

    tp_group: dist.ProcessGroup | None
    """Process group of this rank's tensor-parallel peers; None when ``tp_ranks`` has one rank."""
    tp_ranks: tuple[int, ...]
    """Global ranks of the TP group in TP-rank order. ``tp_ranks[0]`` is the source that reads data."""
    tp_rank: int
    """This rank's index in ``tp_ranks``."""
    pp_rank: int = 0
    """This rank's pipeline stage index, 0-based."""
    pp_size: int = 1
    """Number of pipeline stages."""
    vp_stage: int | None = None
    """Virtual pipeline chunk this call serves (interleaved schedules), or None."""
    vp_size: int | None = None
    """Number of virtual chunks per stage, or None without virtual pipelining."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Device of the tensors every TP rank returns: CUDA for NCCL groups, CPU for gloo."""
    cp_group: dist.ProcessGroup | None = None
    """Process group of this rank's context-parallel peers; None without context parallelism."""
    cp_ranks: tuple[int, ...] = ()
    """Global ranks of the CP group in CP-rank order; empty without context parallelism (cp_size 1)."""
    cp_rank: int = 0
    """This rank's index in ``cp_ranks`` (0 without context parallelism)."""
    cp_layout: CpLayout = "document"
    """How a row is split over CP ranks: "document" or "row" (`megapack.core.cp_share`)."""
    mtp: bool = False
    """This stage holds multi-token-prediction layers (Megatron's ``mtp_on_this_rank``), which embed
    tokens and position_ids and compute a loss: it gets the fields of both ends (`Stage.MTP`)."""
    _stage: Stage = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tp_ranks:
            raise ValueError("Topology.tp_ranks is empty; it must list the TP group's global ranks")
        if not 0 <= self.tp_rank < len(self.tp_ranks):
            raise ValueError(f"Topology.tp_rank={self.tp_rank} is outside tp_ranks={self.tp_ranks}")
        if len(self.tp_ranks) > 1 and self.tp_group is None:
            raise ValueError(f"Topology.tp_group is None but tp_ranks={self.tp_ranks} has peers")
        if self.pp_size < 1 or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"Topology.pp_rank={self.pp_rank} is outside pp_size={self.pp_size}")
        if (self.vp_size is None) != (self.vp_stage is None):
            raise ValueError(
                f"Topology.vp_stage={self.vp_stage} and vp_size={self.vp_size}: give both or neither"
            )
        if (
            self.vp_size is not None
            and self.vp_stage is not None
            and not 0 <= self.vp_stage < self.vp_size
        ):
            raise ValueError(f"Topology.vp_stage={self.vp_stage} is outside vp_size={self.vp_size}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"Topology.cp_rank={self.cp_rank} is outside cp_ranks={self.cp_ranks}")
        if len(self.cp_ranks) > 1 and self.cp_group is None:
            raise ValueError(f"Topology.cp_group is None but cp_ranks={self.cp_ranks} has peers")
        if not isinstance(self.mtp, bool):
            raise TypeError(f"Topology.mtp must be a bool, got {type(self.mtp).__name__}")
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"Topology.cp_layout={self.cp_layout!r} is not one of {CP_LAYOUTS}")
        object.__setattr__(self, "_stage", self._role())

    @property
    def tp_size(self) -> int:
        return len(self.tp_ranks)

    @property
    def cp_size(self) -> int:
        """Number of context-parallel ranks (1 without context parallelism)."""
        return max(1, len(self.cp_ranks))

    @property
    def src_rank(self) -> int:
        """Global rank of the TP source (TP rank 0), the only rank that reads the data iterator."""
        return self.tp_ranks[0]

    @property
    def is_source(self) -> bool:
        return self.tp_rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0 and (self.vp_stage is None or self.vp_stage == 0)

    @property
    def is_last_stage(self) -> bool:
        last_chunk = self.vp_stage is None or self.vp_stage == (self.vp_size or 1) - 1
        return self.pp_rank == self.pp_size - 1 and last_chunk

    @property
    def stage(self) -> Stage:
        return self._stage  # every transfer call asks: worked out once, in __post_init__

    def _role(self) -> Stage:
        if self.is_first_stage and self.is_last_stage:
            return Stage.ONLY
        if self.mtp:
            return Stage.MTP
        if self.is_first_stage:
            return Stage.FIRST
        if self.is_last_stage:
            return Stage.LAST
        return Stage.MIDDLE

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Topology:
        """A topology of one rank (tp=1, pp=1): no communication at all."""
        return cls(tp_group=None, tp_ranks=(0,), tp_rank=0, device=torch.device(device))

    @classmethod
    def from_groups(
        cls,
        tp_group: dist.ProcessGroup | None,
        *,
        pp_rank: int = 0,
        pp_size: int = 1,
        vp_stage: int | None = None,
        vp_size: int | None = None,
        device: torch.device | str | None = None,
        cp_group: dist.ProcessGroup | None = None,
        cp_layout: CpLayout = "document",
        mtp: bool = False,
    ) -> Topology:
        """Build a topology from a TP process group a script created itself.

        Args:
            tp_group: this rank's TP group (from ``dist.new_group``); None for tp=1.
            pp_rank, pp_size: this rank's pipeline stage and the number of stages.
            vp_stage, vp_size: virtual pipeline chunk and chunk count, or None.
            device: where returned tensors live; by default CUDA's current device when the group
                uses NCCL, else CPU.
            cp_group: this rank's context-parallel group; None (or a group of one) without CP.
            cp_layout: "document" or "row", how rows are split over CP ranks (`megapack.core.cp_share`).
            mtp: this stage holds multi-token-prediction layers (``mtp_on_this_rank``).
        """
        if tp_group is None:
            ranks: tuple[int, ...] = (dist.get_rank() if dist.is_initialized() else 0,)
            tp_rank = 0
        else:
            ranks = tuple(dist.get_process_group_ranks(tp_group))
            tp_rank = dist.get_rank(tp_group)
            if tp_rank < 0:
                raise ValueError(
                    f"this rank ({dist.get_rank()}) is not a member of tp_group {ranks}"
                )
        cp_ranks: tuple[int, ...] = ()
        cp_rank = 0
        if cp_group is not None:
            cp_ranks = tuple(dist.get_process_group_ranks(cp_group))
            cp_rank = dist.get_rank(cp_group)
            if cp_rank < 0:
                raise ValueError(
                    f"this rank ({dist.get_rank()}) is not a member of cp_group {cp_ranks}"
                )
            if len(cp_ranks) == 1:
                cp_group, cp_ranks = None, ()
        return cls(
            tp_group=tp_group if len(ranks) > 1 else None,
            tp_ranks=ranks,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            pp_size=pp_size,
            vp_stage=vp_stage,
            vp_size=vp_size,
            device=torch.device(device) if device is not None else default_device(tp_group),
            cp_group=cp_group,
            cp_ranks=cp_ranks,
            cp_rank=cp_rank,
            cp_layout=cp_layout,
            mtp=mtp,
        )

    @classmethod
    def from_pg_collection(
        cls,
        pg_collection: Any,
        *,
        vp_stage: int | None = None,
        vp_size: int | None = None,
        device: torch.device | str | None = None,
        cp_layout: CpLayout = "document",
        mtp: bool = False,
    ) -> Topology:
        """Read this rank's place from a megatron-core ``ProcessGroupCollection``.

        megatron-core (0.14 onwards) and Megatron-Bridge hand their modules a
        ``ProcessGroupCollection`` instead of reading the global ``parallel_state``; its ``tp``,
        ``pp`` and ``cp`` groups are what a `Topology` needs. Any object with those attributes
        works (a ``SimpleNamespace(tp=..., pp=..., cp=...)`` on a megatron-core without the
        class); megatron-core 0.19's ``MultiModuleProcessGroupCollection`` gives its language
        model's collection. ``pp`` and ``cp`` may be absent or None (one stage, no context
        parallelism); the pipeline stage is this rank's index in ``pp``, as megatron-core's
        ``is_pp_first_stage(pg_collection.pp)`` reads it.

        Args:
            pg_collection: the collection (``pg_collection.tp`` is required).
            vp_stage, vp_size: the virtual pipeline chunk this call serves and the chunk count
                (Bridge's ``cfg.model.virtual_pipeline_model_parallel_size``): both or neither.
                A collection does not know the chunks.
            device: where returned tensors live; by default CUDA's current device when the TP
                group uses NCCL, else CPU.
            cp_layout: "document" or "row", how rows are split over CP ranks (`megapack.core.cp_share`).
            mtp: this stage holds multi-token-prediction layers.

        Raises:
            TypeError: ``pg_collection`` has no ``tp`` group, or a group is not a ProcessGroup.
            ValueError: this rank is not in one of its groups; ``vp_stage`` without ``vp_size``.

        Example:
            tp=2 x pp=2 on 4 ranks, global rank 3 (``pg.tp`` holds ranks 2, 3; ``pg.pp`` ranks 1,
            3): ``Topology.from_pg_collection(pg)`` gives ``tp_ranks=(2, 3)``, ``tp_rank=1``,
            ``pp_rank=1``, ``pp_size=2``: a receiver on the LAST stage whose source is rank 2.
        """
        groups = _language_model_groups(pg_collection)
        tp = _group(groups, "tp")
        if tp is None:
            raise TypeError(
                f"pg_collection ({type(pg_collection).__name__}) has no tp group: pass megatron-core's "
                "ProcessGroupCollection (e.g. ProcessGroupCollection.use_mpu_process_groups()) or "
                "an object whose .tp is this rank's tensor-parallel group"
            )
        pp, cp = _group(groups, "pp"), _group(groups, "cp")
        pp_rank, pp_size = 0, 1
        if pp is not None:
            pp_rank, pp_size = dist.get_rank(pp), dist.get_world_size(pp)
            if pp_rank < 0:
                raise ValueError(
                    f"this rank ({dist.get_rank()}) is not a member of pg_collection.pp "
                    f"{tuple(dist.get_process_group_ranks(pp))}"
                )
        if (vp_stage is None) != (vp_size is None):
            raise ValueError(
                f"Topology.from_pg_collection: vp_stage={vp_stage} and vp_size={vp_size}: give "
                "both (the chunk this call serves and the number of chunks) or neither"
            )
        return cls.from_groups(
            tp,
            pp_rank=pp_rank,
            pp_size=pp_size,
            vp_stage=vp_stage,
            vp_size=vp_size,
            device=device,
            cp_group=cp,
            cp_layout=cp_layout,
            mtp=mtp,
        )

    @classmethod
    def from_parallel_state(
        cls, *, vp_stage: int | None = None, cp_layout: CpLayout = "document", mtp: bool = False
    ) -> Topology:
        """Read this rank's place from megatron-core's initialized ``parallel_state``.

        Args:
            vp_stage: the virtual pipeline chunk being served, required when megatron-core was
                initialized with ``virtual_pipeline_model_parallel_size``.
            cp_layout: "document" or "row", how rows are split over context-parallel ranks
                (used when ``context_parallel_size > 1``; `megapack.core.cp_share`).
            mtp: this stage holds multi-token-prediction layers: pass Megatron's
                ``mtp_on_this_rank(config, vp_stage=...)``.
        """
        from megapack.core.quiet import quiet_megatron

        with quiet_megatron():  # lazy: importing megatron takes ~5 s
            from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron-core parallel_state is not initialized: call "
                "parallel_state.initialize_model_parallel(...) first, or pass topology=Topology.from_groups(...)"
            )
        vp_size = ps.get_virtual_pipeline_model_parallel_world_size()
        if vp_size is not None and vp_stage is None:
            raise ValueError(
                f"virtual pipeline parallelism is on (vp_size={vp_size}): pass vp_stage= for the model chunk"
            )
        if vp_size is None and vp_stage is not None:
            raise ValueError(f"vp_stage={vp_stage} given but virtual pipeline parallelism is off")
        group = ps.get_tensor_model_parallel_group()
        return cls.from_groups(
            group if ps.get_tensor_model_parallel_world_size() > 1 else None,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            vp_stage=vp_stage,
            vp_size=vp_size,
            cp_group=ps.get_context_parallel_group()
            if ps.get_context_parallel_world_size() > 1
            else None,
            cp_layout=cp_layout,
            mtp=mtp,
        )


def resolve_topology(
    topology: Topology | None,
    pg_collection: Any = None,
    *,
    vp_stage: int | None = None,
    vp_size: int | None = None,
) -> Topology | None:
    """The topology of a call that takes ``topology=`` or ``pg_collection=`` (never both).

    Args:
        topology: a `Topology`, or None.
        pg_collection: a megatron-core ``ProcessGroupCollection`` (or an object with ``tp``,
            ``pp``, ``cp`` groups), or None: `Topology.from_pg_collection`.
        vp_stage, vp_size: the virtual pipeline chunk and chunk count for ``pg_collection``
            (a collection does not know them); a `Topology` carries its own.

    Returns:
        ``topology``, or the one read from ``pg_collection``; None when neither is given, so
        that the caller's own default applies (e.g. `Topology.from_parallel_state`).

    Raises:
        TypeError: ``topology`` is not a `Topology`, or ``pg_collection`` has no ``tp`` group.
        ValueError: both are given, or ``vp_stage``/``vp_size`` with a ``topology``.

    Example:
        ``resolve_topology(None, pg)`` is ``Topology.from_pg_collection(pg)``;
        ``resolve_topology(topo, None)`` is ``topo``; ``resolve_topology(None, None)`` is None.
    """
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(
            f"topology must be a megapack.Topology or None, got {type(topology).__name__}"
        )
    if topology is not None and pg_collection is not None:
        raise ValueError(
            "got both topology= and pg_collection=: pass one (topology=Topology.from_pg_collection"
            "(pg_collection, ...) when you need its options)"
        )
    if pg_collection is not None:
        return Topology.from_pg_collection(pg_collection, vp_stage=vp_stage, vp_size=vp_size)
    if topology is not None and (vp_stage is not None or vp_size is not None):
        raise ValueError(
            f"vp_stage={vp_stage}, vp_size={vp_size} go with pg_collection=; a Topology carries "
            f"its own (this one: vp_stage={topology.vp_stage}, vp_size={topology.vp_size})"
        )
    return topology


def _language_model_groups(pg_collection: Any) -> Any:
    """The collection itself, or a multi-module collection's language model's (megatron-core 0.19)."""
    if getattr(pg_collection, "tp", None) is None:
        language_model = getattr(pg_collection, "get_language_model_collection", None)
        if callable(language_model) and getattr(pg_collection, "language_model_module_name", None):
            return language_model()
    return pg_collection


def _group(groups: Any, name: str) -> dist.ProcessGroup | None:
    """``groups.<name>``: a ProcessGroup, or None where it is absent or unset (megatron-core 0.19
    gives None for a field never set, 0.16 raises AttributeError: both read as None here)."""
    group = getattr(groups, name, None)
    if group is None:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"pg_collection.{name} must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__}"
        )
    return group


def default_device(group: dist.ProcessGroup | None) -> torch.device:
    """CUDA's current device when ``group`` (or the default group) communicates over NCCL, else CPU."""
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = dist.get_backend(group) if group is not None else dist.get_backend()
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
