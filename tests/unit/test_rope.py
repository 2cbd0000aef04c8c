"""megapack's THD RoPE against megatron-core 0.16's own ``apply_rotary_pos_emb`` THD path (fp32, CPU).

megapack rotates every token by its position in its buffer segment, computed on the device from the
boundaries (`Documents.offsets`, under CP the plan's offsets); megatron-core splits the tokens per
document on the host. Both are fed megatron-core's own ``RotaryEmbedding`` table (plain, interleaved,
``rotary_percent < 1``, a YaRN-like ``mscale``) and must agree within 1e-6.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megapack.attention.cp_plan import CpPlan
from megapack.attention.documents import Documents
from megapack.attention.rope import RopeTables, apply_rope, hand_over, handed_over
from megapack.core.cp_share import cp_indices

HEADS, DIM = 3, 16
BOUNDARIES = {  # (cu_real, cu_buffer or None); the table has max span + 2 rows, never T
    "unpadded": ([0, 5, 12, 13, 20], None),
    "one-token-docs": ([0, 1, 2, 9, 10], None),
    "padded": ([0, 3, 4, 9, 16], [0, 4, 8, 12, 20]),
    "padded-one-token": ([0, 1, 2, 6], [0, 8, 16, 24]),
}


def megatron_table(
    rows: int, *, interleaved: bool = False, percent: float = 1.0, dim: int = DIM
) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()  # RotaryEmbedding moves its frequencies to "the current CUDA device"
    rope = RotaryEmbedding(
        dim, percent, rotary_interleaved=interleaved, use_cpu_initialization=True
    )
    return rope.get_emb(rows)


def megatron_thd(
    t: torch.Tensor, table: torch.Tensor, cu: torch.Tensor, *, interleaved: bool, mscale: float,
    cp: tuple[int, int] = (1, 0),
) -> torch.Tensor:  # fmt: skip
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=interleaved,
                             multi_latent_attention=False)  # fmt: skip
    group = SimpleNamespace(size=lambda: cp[0], rank=lambda: cp[1])
    return apply_rotary_pos_emb(t, table, config, cu_seqlens=cu, mscale=mscale, cp_group=group)


@pytest.mark.parametrize("case", list(BOUNDARIES))
@pytest.mark.parametrize(
    "interleaved,percent,mscale",
    [(False, 1.0, 1.0), (True, 1.0, 1.0), (False, 0.5, 1.0), (True, 0.25, 1.3)],
    ids=["plain", "interleaved", "percent-0.5", "interleaved-percent-0.25-mscale"],
)
def test_rope_equals_megatron_thd_path(case: str, interleaved: bool, percent: float, mscale: float) -> None:  # fmt: skip
    real, buffer = BOUNDARIES[case]
    cu_real = torch.tensor(real, dtype=torch.int32)
    cu_buffer = cu_real if buffer is None else torch.tensor(buffer, dtype=torch.int32)
    total = int(cu_buffer[-1])
    spans = (cu_buffer[1:] - cu_buffer[:-1]).tolist()
    table = megatron_table(max(spans) + 2, interleaved=interleaved, percent=percent)
    assert table.shape[0] != total  # megatron-core's "exact mapping" mode would take over at T
    if percent < 1:
        assert table.shape[-1] == int(DIM * percent) < DIM  # only part of the head dim rotates
    t = torch.randn(total, HEADS, DIM, generator=torch.Generator().manual_seed(len(real)))
    docs = Documents(cu_real, cu_buffer, max(spans), total)
    ours = apply_rope(t, table, docs.offsets(), interleaved=interleaved, mscale=mscale)
    # megatron-core rotates by buffer segments (attention passes cu_seqlens_q_padded)
    want = megatron_thd(t, table, cu_buffer, interleaved=interleaved, mscale=mscale)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)
    if percent < 1:
        assert torch.equal(ours[..., table.shape[-1] :], t[..., table.shape[-1] :])
    assert not torch.allclose(ours[1:], t[1:])  # it did rotate


@pytest.mark.parametrize("cp", [2, 4])
def test_rope_under_cp_equals_megatron_thd_cp_path(cp: int) -> None:
    """The "document" layout: megatron-core's THD RoPE with a CP group rotates the same tokens."""
    real, buffer = [0, 3, 8, 24, 25], [0, 8, 16, 32, 40]  # spans divide by 2 * cp
    cu_real, cu_buffer = torch.tensor(real), torch.tensor(buffer)
    table = megatron_table(18)
    t_row = torch.randn(buffer[-1], HEADS, DIM, generator=torch.Generator().manual_seed(cp))
    for rank in range(cp):
        plan = CpPlan.build(cu_buffer, cu_real, cp_size=cp, cp_rank=rank, layout="document",
                            local_total=buffer[-1] // cp)  # fmt: skip
        t = t_row[cp_indices(buffer, cp, rank)]
        ours = apply_rope(t, table, plan.offsets, interleaved=False)
        want = megatron_thd(t, table, cu_buffer, interleaved=False, mscale=1.0, cp=(cp, rank))
        torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)


def test_rope_cos_sin_are_computed_once_per_micro_batch() -> None:
    cu = torch.tensor([0, 5, 12])
    docs = Documents(cu, cu, 7, 12)
    table = megatron_table(9)
    t = torch.randn(12, HEADS, DIM)
    first = apply_rope(t, table, docs.offsets(), interleaved=False, docs=docs)
    (key,) = [k for k in docs.memo if k[0] == "rope"]
    cos = docs.memo[key][2]
    second = apply_rope(t, table, docs.offsets(), interleaved=False, docs=docs)
    assert docs.memo[key][2] is cos and torch.equal(first, second)


def test_rope_refuses_tables_it_cannot_apply() -> None:
    t = torch.zeros(4, HEADS, DIM)
    positions = torch.arange(4)
    with pytest.raises(ValueError, match=r"must be megatron-core's \[max_seqlen, 1, 1, rotary_dim\], got shape \(6, 2, 1, 16\)"):  # fmt: skip
        apply_rope(t, torch.zeros(6, 2, 1, DIM), positions, interleaved=False)
    with pytest.raises(ValueError, match="rotary_dim=32 must be even and at most the head dim 16"):
        apply_rope(t, torch.zeros(6, 1, 1, 32), positions, interleaved=False)
    with pytest.raises(ValueError, match="rotary_dim=5 must be even"):
        apply_rope(t, torch.zeros(6, 1, 1, 5), positions, interleaved=False)


def test_rope_hand_over_travels_on_packed_seq_params() -> None:
    params = SimpleNamespace()
    tables = RopeTables(q=torch.zeros(2, 1, 1, 4), k=None)
    assert hand_over(params, tables) and handed_over(params) is tables
    assert hand_over(params, None) and handed_over(params) is None  # a later forward without RoPE
    assert not hand_over(object(), tables)  # no __dict__: megatron-core keeps its own RoPE
