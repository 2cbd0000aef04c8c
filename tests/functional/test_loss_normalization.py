"""Every loss mode's gradient is its definition's, however the step is packed (issue 31), CPU gloo.

One fixed global batch of documents (1 token to longer than a row, one fully masked, prompts
masked, one split by `split_document`) trains one step of megatron-core's GPTModel under its own
schedule, its ``DistributedDataParallel`` and ``finalize_model_grads``, with
``calculate_per_token_loss`` off and on. The parameter gradient must equal, for every mode, a
single-rank reference computed from the mode's definition over the pieces one at a time,
unpacked (relative 1e-5, fp32).

Inputs, each the same documents:
    packed   `PackedDataset(loss_fields=True)`, split pieces one document ("whole")
    padded   one piece per [b, S] row, Megatron SFT-style, through `with_loss_fields` ("pieces")
    rl       hand-packed rows with GRPO advantages and old log-probs, `policy_loss`, advantages of
             both signs and ratios on both sides of the clip range ("pieces")
    derived  `PackedDataset` without loss fields: calculate_per_token_loss=True only, the
             documents' counts derived on the device ("pieces")

The grid covers DP {1, 2}, CP {1, 2} in both layouts, PP {1, 2}, TP {1, 2}, rows per micro-batch
{1, 2} and micro-batches per step {1, 4} (`GRID`), not their product. ``micro_batch_mean`` is
checked against its own definition on each input, and shown to differ between packed and padded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import pytest
import torch

from megapack import LOSS_FIELDS, BatchField, PackedBatch
from megapack.data import Document, PackedDataset, split_document
from megapack.harness.gpt import TinyGPT, forward_step, global_parameters, init_weights
from megapack.megatron import LOSS_MODES

pytestmark = pytest.mark.distributed

S = 32  # row length
GPT = TinyGPT(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
              vocab_size=128, max_sequence_length=S)  # fmt: skip
RL = (
    BatchField("advantages", "token", torch.float32, "last", at="label"),
    BatchField("old_logprobs", "token", torch.float32, "last", at="label"),
)
SEQUENCE_MODES = ("token_mean", "sequence_mean", "sequence_sum")
# (tp, pp, cp, dp, cp layout, rows per micro-batch, micro-batches per step): dp * M * rows >= 4
GRID = [
    (1, 1, 1, 1, "document", 1, 4),
    (1, 1, 1, 2, "document", 2, 1),
    (2, 1, 1, 1, "document", 2, 4),
    (1, 2, 1, 1, "document", 1, 4),
    (1, 1, 2, 1, "document", 1, 4),
    (1, 1, 2, 1, "row", 2, 4),
    (2, 2, 1, 2, "document", 1, 4),
    (1, 2, 2, 2, "row", 2, 1),
    (2, 1, 2, 2, "document", 1, 4),
]
RTOL = 1e-5


def documents() -> list[Document]:
    """The fixed global batch: lengths 1 to 40 (> S: split at its boundary 24), prompts masked."""
    rng = np.random.default_rng(31)
    masks = {2: "none", 3: "prompt", 5: "prompt", 7: "prompt"}
    out = []
    for i, n in enumerate([1, 2, 3, 5, 8, 13, 32, 40]):
        mask = np.ones(n, dtype=np.float32)
        if masks.get(i) == "none":
            mask[:] = 0
        elif masks.get(i) == "prompt":
            mask[: n // 3 + 1] = 0
        out.append(Document(tokens=rng.integers(1, 127, n), loss_mask=mask,
                            boundaries=(24,) if n > 24 else (), source=f"doc{i}"))  # fmt: skip
    return out


def pieces() -> tuple[list[Document], list[int]]:
    """The documents as `PackedDataset` stores them (split to fit S), and each piece's document."""
    out, origins = [], []
    for i, doc in enumerate(documents()):
        for piece in split_document(doc, S):
            out.append(piece)
            origins.append(i)
    return out, origins


def rl_values(index: int, n: int) -> dict[str, np.ndarray]:
    """A piece's advantages (one sign per piece, GRPO-style) and old log-probs (ratios spread
    past both ends of the clip range around the initial model's)."""
    rng = np.random.default_rng(100 + index)
    sign = (-1.0, 1.5, -0.5)[index % 3]
    return {"advantages": np.full(n, sign, dtype=np.float32),
            "old_logprobs": (np.log(1 / 128) + rng.normal(0, 0.6, n)).astype(np.float32)}  # fmt: skip


# ------------------------------------------------------------------ the inputs and their membership


def packed_dataset(config: tuple[Any, ...], dp_rank: int, *, loss_fields: bool) -> PackedDataset:
    _, _, cp, dp, layout, rows, micro = config
    ds = PackedDataset(documents(), seq_len=S, rows_per_micro_batch=rows, dp_rank=dp_rank,
                       dp_size=dp, micro_batches=micro, cp_size=cp if layout == "document" else 1,
                       loss_fields=loss_fields)  # fmt: skip
    assert len(ds) == micro, "the documents must fill exactly one step"
    return ds


def packed_members(config: tuple[Any, ...]) -> list[list[int]]:
    """Pieces of each global micro-batch of the packed input, in order."""
    ds = packed_dataset(config, 0, loss_fields=False)
    rows, order, a = config[5], ds.order(), ds._arrays
    return [[int(doc) for r in order[j * rows : (j + 1) * rows] if r >= 0
             for doc, _, _ in a["slices"][a["bin_offsets"][r] : a["bin_offsets"][r + 1]]]
            for j in range(len(order) // rows)]  # fmt: skip


def padded_members(config: tuple[Any, ...]) -> list[list[int]]:
    """One piece per row, dealt in order, ceil(pieces / micro-batches) rows a micro-batch."""
    slots = config[3] * config[6]
    count = len(pieces()[0])
    per = -(-count // slots)
    return [list(range(j * per, min((j + 1) * per, count))) for j in range(slots)]


def rl_rows(config: tuple[Any, ...]) -> list[list[int]]:
    """Hand-packed rows (first fit, longest first, CP-aligned lengths), one row per slot."""
    _, _, cp, dp, layout, rows, micro = config
    multiple = 2 * cp if layout == "document" else 1
    sizes = [-(-len(p) // multiple) * multiple for p in pieces()[0]]
    bins: list[list[int]] = [[] for _ in range(dp * micro * rows)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        room = next(b for b in bins if sum(sizes[j] for j in b) + sizes[i] <= S)
        room.append(i)
    return bins


def rl_members(config: tuple[Any, ...]) -> list[list[int]]:
    rows, bins = config[5], rl_rows(config)
    return [
        [i for b in bins[j * rows : (j + 1) * rows] for i in b] for j in range(len(bins) // rows)
    ]


def padded_input(config: tuple[Any, ...], dp_rank: int) -> list[dict[str, torch.Tensor]]:
    docs, members, dp = pieces()[0], padded_members(config), config[3]
    per = max(len(m) for m in members)
    out = []
    for j in range(dp_rank, len(members), dp):
        rows = [PackedBatch.from_documents([docs[i]], seq_len=S) for i in members[j]]
        rows += [_filler_row()] * (per - len(rows))
        out.append({k: torch.cat([getattr(r, k) for r in rows])
                    for k in ("tokens", "labels", "loss_mask", "position_ids")})  # fmt: skip
    return out


def rl_input(config: tuple[Any, ...], dp_rank: int) -> list[PackedBatch]:
    _, _, cp, dp, layout, rows, _ = config
    docs, bins = pieces()[0], rl_rows(config)
    pad = 2 * cp if layout == "document" else 1

    def row(members: list[int]) -> PackedBatch:
        if not members:
            filler = {"tokens": [0] * S, "loss_mask": [0.0] * S,
                      **{f.name: np.zeros(S, dtype=np.float32) for f in RL}}  # fmt: skip
            return PackedBatch.from_documents(
                [filler], seq_len=S, pad_to_multiple_of=pad, fields=RL
            )
        given = [{"tokens": docs[i].tokens, "loss_mask": docs[i].loss_mask,
                  **rl_values(i, len(docs[i]))} for i in members]  # fmt: skip
        return PackedBatch.from_documents(given, seq_len=S, pad_to_multiple_of=pad, fields=RL)

    micro = len(bins) // rows
    return [PackedBatch.concat([row(bins[j * rows + k]) for k in range(rows)], RL)
            for j in range(dp_rank, micro, dp)]  # fmt: skip


def _filler_row() -> PackedBatch:
    return PackedBatch.from_documents([{"tokens": [0] * S, "loss_mask": [0.0] * S}], seq_len=S)


# ------------------------------------------------------------------ the single-rank reference


def weights(mode: str, members: list[list[int]], *, whole: bool) -> list[np.ndarray]:
    """Each piece's per-position weight (of the label at that position) under ``mode``'s definition."""
    docs, origins = pieces()
    trained = [(d.loss_mask[1:] != 0).astype(np.float64) for d in docs]  # label i is token i + 1
    key = origins if whole else list(range(len(docs)))
    per_doc: dict[int, float] = {}
    for i, t in enumerate(trained):
        per_doc[key[i]] = per_doc.get(key[i], 0.0) + t.sum()
    total = sum(t.sum() for t in trained)
    counted = sum(1 for v in per_doc.values() if v > 0)
    out = [np.zeros(len(d)) for d in docs]
    for i, t in enumerate(trained):
        if mode == "token_mean":
            out[i][:-1] = t / total
        elif mode == "sequence_mean":
            out[i][:-1] = t / (max(per_doc[key[i]], 1.0) * counted)
        elif mode == "sequence_sum":
            out[i][:-1] = t / counted
    if mode == "micro_batch_mean":
        for m in members:
            n = sum(trained[i].sum() for i in m)
            for i in m:
                out[i][:-1] = trained[i] / (max(n, 1.0) * len(members))
    return out


def reference_task(cases: dict[str, tuple[str, list[list[int]], bool, bool]]) -> dict[str, Any]:
    """Full gradients by global parameter name for each case (mode, members, whole, rl), on one
    rank: each piece's own forward (one document, unpacked), summed with the mode's weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack.harness.megatron_cpu import megatron_on_cpu
    from megapack.megatron.loss import _surrogate

    megatron_on_cpu()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    model = GPT.build()
    init_weights(model, seed=7)
    docs = pieces()[0]
    out: dict[str, Any] = {}
    ratios: list[torch.Tensor] = []
    for name, (mode, members, whole, rl) in cases.items():
        model.zero_grad()
        w = weights(mode, members, whole=whole)
        for i, doc in enumerate(docs):
            b = PackedBatch.from_documents([doc])
            per_token = model(b.tokens, b.position_ids, None, labels=b.labels,
                              packed_seq_params=b.to_packed_seq_params())  # fmt: skip
            if rl:  # the fields sit at their tokens' positions, as PackedBatch places them
                v = {k: torch.from_numpy(x)[None] for k, x in rl_values(i, len(doc)).items()}
                ratios.append(torch.exp(-per_token.detach() - v["old_logprobs"])[0, :-1])
                per_token = _surrogate(v["advantages"], v["old_logprobs"], per_token, 0.2)
            (per_token[0].double() * torch.from_numpy(w[i])).sum().backward()
        out[name] = {n: p.grad.clone() for n, p, _ in global_parameters(model)}
    out["ratios"] = torch.cat(ratios)
    return out


# ------------------------------------------------------------------ the distributed run


def grid_task(config: tuple[Any, ...], references: dict[str, Any]) -> dict[str, float]:
    """One step per (input, mode, calculate_per_token_loss) on this topology; each one's relative
    gradient error against its reference, on this rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megapack import Topology, with_loss_fields
    from megapack.harness.megatron_cpu import megatron_on_cpu

    tp, pp, cp, _, layout, _, micro = config
    megatron_on_cpu()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp)  # fmt: skip
    model_parallel_cuda_manual_seed(1234)
    topology = Topology.from_parallel_state(cp_layout=layout)
    dp_rank = ps.get_data_parallel_rank()
    errors: dict[str, float] = {}
    for per_token in (False, True):
        ddp = _ddp_model(layout, per_token)
        for kind in ("packed", "padded", "rl", "derived"):
            if kind == "derived" and not per_token:
                continue
            for mode in LOSS_MODES:
                if kind == "derived" and mode == "micro_batch_mean":
                    continue
                items: Any = None
                if topology.is_source:
                    if kind in ("packed", "derived"):
                        items = iter(packed_dataset(config, dp_rank, loss_fields=kind == "packed"))
                    else:
                        raw = (
                            padded_input(config, dp_rank)
                            if kind == "padded"
                            else rl_input(config, dp_rank)
                        )
                        items = with_loss_fields(raw, micro_batches=micro)
                fields = (() if kind == "derived" else LOSS_FIELDS) + (RL if kind == "rl" else ())
                grads = _one_step(ddp, topology, items, kind, mode, per_token, fields, config)
                reference = references[_case(kind, mode, config)]
                errors[f"{kind}/{mode}/per_token={per_token}"] = _relative_error(
                    grads, reference, tp
                )
    return errors


def _ddp_model(layout: str, per_token: bool) -> Any:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    model = dataclasses.replace(GPT, cp_layout=layout).build()  # type: ignore[arg-type]
    init_weights(model, seed=7)
    config = model.config
    config.calculate_per_token_loss = per_token
    config.finalize_model_grads_func = (
        finalize_model_grads  # as Megatron-LM's training loop sets it
    )
    return DistributedDataParallel(config, DistributedDataParallelConfig(), model)


def _one_step(ddp: Any, topology: Any, items: Any, kind: str, mode: str, per_token: bool,
              fields: tuple[Any, ...], config: tuple[Any, ...]) -> dict[str, Any]:  # fmt: skip
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megapack.megatron import normalized_loss, policy_loss

    layout, rows, micro = config[4], config[5], config[6]
    loss = policy_loss if kind == "rl" else normalized_loss

    def make_loss(batch: dict[str, Any], cp_group: Any) -> Any:
        # packed batches name their CP group in packed_seq_params (the default); plain rows cannot
        group = {"cp_group": cp_group} if kind == "padded" else {}
        return functools.partial(loss, batch, mode=mode, calculate_per_token_loss=per_token,
                                 cp_layout=layout, **group)  # fmt: skip

    padded = kind == "padded"
    per = max(len(m) for m in padded_members(config)) if padded else 1
    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=functools.partial(forward_step, topology, fields=fields, loss=make_loss),
        data_iterator=items, model=[ddp], num_microbatches=micro,
        seq_length=S if padded else rows * S, micro_batch_size=per, forward_only=False,
    )  # fmt: skip
    return {name: (p.main_grad.clone(), dim) for name, p, dim in global_parameters(ddp)}


def _relative_error(grads: dict[str, Any], reference: dict[str, torch.Tensor], tp: int) -> float:
    """||g - ref|| / ||ref|| over this rank's parameters (its TP slices of the full gradients)."""
    from megatron.core import parallel_state as ps

    diff = norm = 0.0
    for name, (g, dim) in grads.items():
        ref = reference[name].to(g.dtype)
        if dim is not None:
            ref = ref.chunk(tp, dim=dim)[ps.get_tensor_model_parallel_rank()]
        diff += float((g - ref).double().pow(2).sum())
        norm += float(ref.double().pow(2).sum())
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)


def _case(kind: str, mode: str, config: tuple[Any, ...]) -> str:
    """The reference a run is held to (micro_batch_mean's depends on the input's micro-batches)."""
    rl = kind == "rl"
    whole = kind == "packed"
    if mode == "micro_batch_mean":
        return f"{kind}/{mode}/{config}"
    if mode == "token_mean":
        return f"{'rl' if rl else 'sft'}/{mode}"
    return f"{'rl' if rl else 'sft'}/{mode}/{'whole' if whole else 'pieces'}"


def reference_cases() -> dict[str, tuple[str, list[list[int]], bool, bool]]:
    cases: dict[str, tuple[str, list[list[int]], bool, bool]] = {}
    for rl in (False, True):
        name = "rl" if rl else "sft"
        cases[f"{name}/token_mean"] = ("token_mean", [], False, rl)
        for mode in ("sequence_mean", "sequence_sum"):
            cases[f"{name}/{mode}/pieces"] = (mode, [], False, rl)
            if not rl:
                cases[f"{name}/{mode}/whole"] = (mode, [], True, rl)
    members = {"packed": packed_members, "padded": padded_members, "rl": rl_members}
    for config in GRID:
        for kind, of in members.items():
            cases[f"{kind}/micro_batch_mean/{config}"] = (
                "micro_batch_mean",
                of(config),
                False,
                kind == "rl",
            )
    return cases


@pytest.fixture(scope="module")
def references(dist_pool: Any) -> dict[str, Any]:
    return dist_pool.run(reference_task, 1, reference_cases(), timeout=300)[0]


@pytest.mark.parametrize(
    "config", GRID, ids=lambda c: "tp{}-pp{}-cp{}-dp{}-{}-mbs{}-m{}".format(*c)
)
def test_loss_normalization_grid_gradient_equals_the_modes_definition(
    dist_pool: Any, references: dict[str, Any], config: tuple[Any, ...]
) -> None:
    tp, pp, cp, dp = config[:4]
    results = dist_pool.run(grid_task, tp * pp * cp * dp, config, references, timeout=300)
    worst: dict[str, float] = {}
    for errors in results:
        for key, value in errors.items():
            worst[key] = max(worst.get(key, 0.0), value)
    assert len(worst) == 2 * 3 * 4 + 3  # inputs x modes x both settings, derived: per-token only
    bad = {k: v for k, v in worst.items() if not v <= RTOL}
    assert not bad, bad


def test_loss_normalization_micro_batch_mean_depends_on_the_packing(
    references: dict[str, Any],
) -> None:
    # The bug the step modes prevent: the same documents, packed or padded, give another gradient.
    for config in GRID:
        packed = references[f"packed/micro_batch_mean/{config}"]
        padded = references[f"padded/micro_batch_mean/{config}"]
        diff = sum(float((packed[n] - padded[n]).pow(2).sum()) for n in packed)
        norm = sum(float(padded[n].pow(2).sum()) for n in padded)
        assert math.sqrt(diff / norm) > 1e-2, config


def test_loss_normalization_rl_ratios_fall_on_both_sides_of_the_clip_range(
    references: dict[str, Any],
) -> None:
    ratios = references["ratios"]
    assert (ratios < 0.8).any() and (ratios > 1.2).any() and ((ratios > 0.8) & (ratios < 1.2)).any()


# ------------------------------------------------------------------ with_loss_fields over DP ranks


def with_loss_fields_task(case: str) -> dict[str, Any]:
    """Two DP ranks (the world group) read their own micro-batches through `with_loss_fields`."""
    import torch.distributed as dist

    from megapack import with_loss_fields
    from megapack.harness.gpt import padded_micro_batch

    rank = dist.get_rank()
    count = 3 if case == "uneven" and rank == 0 else 2  # uneven: step 1 holds 1 and 0
    micro = [padded_micro_batch([[1, 2, 3][: rank + 2]], 4) for _ in range(count)]
    if case == "failure" and rank == 1:
        micro[1] = {"tokens": torch.zeros(1, 4, dtype=torch.int64)}  # no loss_mask
    out: dict[str, Any] = {"steps": []}
    try:
        for batch in with_loss_fields(iter(micro), micro_batches=2, group=dist.group.WORLD):
            out["steps"].append(batch["loss_step"].tolist())
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def test_loss_with_loss_fields_sums_the_step_over_dp_ranks(dist_pool: Any) -> None:
    even = dist_pool.run(with_loss_fields_task, 2, "even", timeout=60)
    # rank 0: 2 micro-batches of 1 trained token, rank 1: 2 of 2 -> [2 + 4, 2 + 2, 4]; then the end
    assert even[0] == even[1] == {"steps": [[[6, 4, 4]]] * 2}
    uneven = dist_pool.run(with_loss_fields_task, 2, "uneven", timeout=60)
    assert uneven[0]["steps"] == uneven[1]["steps"] == [[[6, 4, 4]]] * 2
    assert all("ValueError: DP ranks [0, 1] read [1, 0] micro-batches for step 1" in r["error"]
               for r in uneven)  # fmt: skip
    failed = dist_pool.run(with_loss_fields_task, 2, "failure", timeout=60)
    assert failed[1]["error"].startswith("ValueError: batch is missing 'loss_mask'")
    assert (
        failed[0]["error"].startswith("RemoteRankError")
        and "missing 'loss_mask'" in failed[0]["error"]
    )
    assert failed[0]["steps"] == failed[1]["steps"] == []
