"""megapack.core.seq_params: megatron-core's PackedSeqParams filled as the installed release
expects, on megatron-core 0.16.1 and 0.19.2 alike.

Each release's class is tested on both lines: the installed one as it is, and the other one's
field set through a stand-in dataclass with exactly its fields (`OLD_FIELDS`, `NEW_FIELDS`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from megapack import PackedBatch, Topology, get_batch_on_this_tp_rank
from megapack.core.megatron_release import MegatronRelease, megatron_release
from megapack.core.seq_params import BUCKETS_ATTR, make_packed_seq_params

CU = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
PADDED = torch.tensor([0, 4, 8, 12], dtype=torch.int32)

OLD_FIELDS = (  # megatron-core 0.16.1's PackedSeqParams, in its order
    "qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
    "max_seqlen_q", "max_seqlen_kv", "local_cp_size", "cp_group",
)  # fmt: skip
NEW_FIELDS = (*OLD_FIELDS, "total_tokens", "seq_idx", "tokens_per_sample", "pad_between_seqs")
"""megatron-core 0.19.2's: four more."""


def stand_in(fields: tuple[str, ...]) -> type:
    """A PackedSeqParams-like dataclass with exactly ``fields``, each defaulting to None."""
    return dataclasses.make_dataclass("PackedSeqParams", [(f, Any, None) for f in fields])


@pytest.fixture
def release_of(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Makes `megatron_release` return a release whose PackedSeqParams has the given fields."""

    def install(fields: tuple[str, ...]) -> type:
        cls = stand_in(fields)
        fake = MegatronRelease(
            version=(0, 0, 0), packed_seq_params=cls, packed_seq_fields=frozenset(fields)
        )
        monkeypatch.setattr("megapack.core.seq_params.megatron_release", lambda: fake)
        return cls

    return install


def test_the_installed_release_is_the_class_megatron_core_defines() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    release = megatron_release()
    assert release is megatron_release()  # probed once
    assert release.packed_seq_params is PackedSeqParams
    assert release.packed_seq_fields == {f.name for f in dataclasses.fields(PackedSeqParams)}
    assert release.packed_seq_fields in (frozenset(OLD_FIELDS), frozenset(NEW_FIELDS))
    assert release.supported
    params = make_packed_seq_params(CU, PADDED, 4, local_cp_size=2)
    assert type(params) is PackedSeqParams and params.qkv_format == "thd"
    assert params.cu_seqlens_q is CU and params.cu_seqlens_kv is CU
    assert params.cu_seqlens_q_padded is PADDED and params.cu_seqlens_kv_padded is PADDED
    assert (params.max_seqlen_q, params.max_seqlen_kv, params.local_cp_size) == (4, 4, 2)


@pytest.mark.parametrize("padded", [PADDED, None], ids=["padded", "unpadded"])
def test_the_installed_release_gets_pad_between_seqs_where_it_has_the_field(
    padded: torch.Tensor | None,
) -> None:
    params = make_packed_seq_params(CU, padded, 4)
    if "pad_between_seqs" in megatron_release().packed_seq_fields:  # megatron-core 0.19
        assert params.pad_between_seqs is (padded is not None)
        # set from a packed batch: nothing of Mamba's or MoE's, so __post_init__ built nothing
        assert (params.total_tokens, params.seq_idx, params.tokens_per_sample) == (None,) * 3
    else:  # megatron-core 0.16: nothing set that the class does not define
        assert not hasattr(params, "pad_between_seqs")
        assert set(vars(params)) == set(OLD_FIELDS)


def test_a_release_with_pad_between_seqs_gets_it_from_whether_padded_boundaries_are_given(
    release_of: Any,
) -> None:
    cls = release_of(NEW_FIELDS)
    padded, plain = make_packed_seq_params(CU, PADDED, 4), make_packed_seq_params(CU, None, 4)
    assert type(padded) is cls and padded.pad_between_seqs is True
    assert plain.pad_between_seqs is False and plain.cu_seqlens_q_padded is None
    equal = make_packed_seq_params(CU, CU.clone(), 4)  # boundaries given, equal to the real ones
    assert equal.pad_between_seqs is True  # decided without comparing them (module docstring)
    for params in (padded, plain):
        assert (params.total_tokens, params.seq_idx, params.tokens_per_sample) == (None,) * 3


def test_a_release_without_the_new_fields_gets_none_of_them(release_of: Any) -> None:
    cls = release_of(OLD_FIELDS)  # megatron-core 0.16.1's fields: its dataclass rejects others
    params = make_packed_seq_params(CU, PADDED, 4, cp_group=None, local_cp_size=2)
    assert type(params) is cls and params.local_cp_size == 2
    assert params.cu_seqlens_q_padded is PADDED


def test_a_value_the_release_cannot_hold_is_an_error_naming_it(release_of: Any) -> None:
    release_of(tuple(f for f in OLD_FIELDS if f not in ("local_cp_size", "cp_group")))
    params = make_packed_seq_params(CU, PADDED, 4, cp_group=None)  # no cp_group field: left out
    assert not hasattr(params, "cp_group")
    make_packed_seq_params(CU, PADDED, 4, cp_group=object())  # read from the config there
    with pytest.raises(ValueError, match=r"no field 'local_cp_size' \(given 2\); upgrade"):
        make_packed_seq_params(CU, PADDED, 4, local_cp_size=2)


def test_whether_boundaries_are_padded_is_decided_without_reading_them() -> None:
    """Boundaries on the meta device have no values: any read (``torch.equal``, ``.item()``,
    ``seq_idx``'s ``repeat_interleave``) raises, so building the params must read none."""
    meta_cu, meta_padded = CU.to("meta"), PADDED.to("meta")
    params = make_packed_seq_params(meta_cu, meta_padded, 4)
    assert params.cu_seqlens_q is meta_cu and params.cu_seqlens_q_padded is meta_padded
    assert getattr(params, "pad_between_seqs", True) is True
    with pytest.raises((NotImplementedError, RuntimeError)):  # the check is a real one
        torch.equal(meta_cu, meta_padded)


def test_buckets_ride_on_the_params() -> None:
    plan = (torch.zeros(2, 4, dtype=torch.int64),)
    assert getattr(make_packed_seq_params(CU, None, 4, buckets=plan), BUCKETS_ATTR) is plan
    assert not hasattr(make_packed_seq_params(CU, None, 4), BUCKETS_ATTR)


def delivered_flags(pad: int) -> dict[str, Any]:
    """On tp 2 (run on every rank): what the source and its peer get for one batch."""
    import torch.distributed as dist

    from megapack.harness.grid import grid_topology

    topo = grid_topology(2, 1)
    batch = PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]], pad_to_multiple_of=pad)
    out = get_batch_on_this_tp_rank(iter([batch]) if topo.tp_rank == 0 else None, topology=topo)
    params = out["packed_seq_params"]
    dist.barrier()
    return {
        "padded": out["cu_seqlens_padded"] is not None,
        "flag": getattr(params, "pad_between_seqs", "absent"),
        "offered": "pad_between_seqs" in megatron_release().packed_seq_fields,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("pad", [4, 1], ids=["padded", "unpadded"])
def test_every_tp_rank_gets_pad_between_seqs_from_the_frame(dist_pool: Any, pad: int) -> None:
    """The peer builds its params from the frame it decodes: the header says whether padded
    boundaries travel, so the flag costs it no read of the boundaries."""
    for r in dist_pool.run(delivered_flags, 2, pad, timeout=120):
        assert r["padded"] is (pad > 1)
        assert r["flag"] == ((pad > 1) if r["offered"] else "absent")


@pytest.mark.parametrize("pad", [4, 1], ids=["padded", "unpadded"])
def test_delivered_batches_carry_pad_between_seqs(pad: int) -> None:
    """The TP source's delivery, built from the frame it decodes: padded boundaries travel, so
    the flag is set; without them it is False."""
    batch = PackedBatch.from_documents([[5, 6, 7], [8, 9], [1, 2, 3, 4]], pad_to_multiple_of=pad)
    out = get_batch_on_this_tp_rank(iter([batch]), topology=Topology.single())
    params = out["packed_seq_params"]
    assert (out["cu_seqlens_padded"] is not None) is (pad > 1)
    if "pad_between_seqs" in megatron_release().packed_seq_fields:
        assert params.pad_between_seqs is (pad > 1)
