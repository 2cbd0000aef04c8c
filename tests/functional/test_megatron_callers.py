"""The migration guide's one-line changes (docs/megatron.md), run in the re-created callers
(`tests.functional.callers`) on tp 2 x pp 1, 2 and 4 (and tp 1 x pp 1) with micro-batch sizes 1
and 2, on megatron-core's ``parallel_state`` over the gloo worker pool.

Each pool task runs, on every rank, every caller form after its guide line: Megatron-LM main's
pretrain_gpt with the import line and with the function line, pretrain_gpt before PR #4103, a
Megatron-Bridge step (``gpt_step.get_batch`` swapped) and a Bridge step of one's own around
``batch_utils.get_batch_on_this_tp_rank``. Each reads Megatron SFT rows with ``-1`` and with
``S`` sentinels, rows with ``cu_seqlens_padded``, plain rows with an attention mask (Bridge: its
current and older packed keys and plain rows), and hands its model what its forward step builds;
every field of every stage must equal the single-rank reference (`callers.data.reference`, one
rank holding everything), a field the stage does not need must be None. Then, on every rank: the
refusal of hybrid CP (the exact message), a bad batch (the source's error on the source,
`RemoteDataError` on its peers), a wrong ``tp_rank`` on one rank (its own error after the frame,
and the next call still right on every rank), and on megatron-core 0.19 Megatron's own function
in the same caller, whose middle stages keep a ``-1`` in ``cu_seqlens`` (pp 4 only: pp 1 and 2 have
no middle stage).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from megapack import RemoteDataError
from megapack.testing.grids import Grid
from tests.functional.callers import guide_lines, load, megatron_core, megatron_training
from tests.functional.callers.data import S, bridge_item, megatron_item, reference, zigzag

pytestmark = pytest.mark.distributed

GRIDS = (Grid(1, 1), Grid(2, 1), Grid(2, 2), Grid(2, 4))
LINES = {
    "import": "(Megatron-LM main): one line after its imports",
    "function": "(Megatron-LM main): or one line after its def get_batch",
    "pre_4103": "(Megatron-LM before PR #4103): the same one line",
    "bridge_step": "in place of: from megatron.bridge.training.gpt_step import get_batch",
    "bridge_recipe": "in place of: from megatron.bridge.training.utils.batch_utils",
}
HYBRID = (
    "get_batch_on_this_tp_rank(is_hybrid_cp=True): megapack cannot honour Megatron-LM's hybrid "
    "context parallelism (--hybrid-context-parallel): the CP group of each micro-batch is chosen "
    "after delivery from its local_cp_size, and its sequence length varies; keep "
    "megatron.core.utils.get_batch_on_this_tp_rank for hybrid-CP runs, or use megapack's context "
    "parallelism (docs/context-parallelism.md)"
)


def _list(t: Any) -> Any:
    if t is None:
        return None
    return t.float().tolist() if t.dtype.is_floating_point else t.tolist()


def view(tokens: Any, position_ids: Any, labels: Any, loss_mask: Any, attention_mask: Any,
         params: Any, padding_mask: Any = None) -> dict[str, Any]:  # fmt: skip
    """What a forward step hands its model, as plain lists."""
    out = {"tokens": _list(tokens), "position_ids": _list(position_ids), "labels": _list(labels),
           "loss_mask": _list(loss_mask), "attention_mask": _list(attention_mask),
           "padding_mask": _list(padding_mask), "cu_q": None, "cu_q_padded": None, "max_seqlen": None}  # fmt: skip
    if params is not None:
        out["cu_q"] = params.cu_seqlens_q.tolist()
        padded = params.cu_seqlens_q_padded
        out["cu_q_padded"] = None if padded is None else padded.tolist()
        out["max_seqlen"] = params.max_seqlen_q
    return out


def expected(item: dict[str, Any], first: bool, last: bool, form: str) -> dict[str, Any]:
    """The reference, as this stage's caller hands it to its model."""
    ref = reference(item)
    packed = ref["cu_seqlens"] is not None
    if not packed and not (first or last):  # every caller skips a middle stage of plain data
        return view(None, None, None, None, None, None)
    out = {"tokens": ref["tokens"] if first else None, "position_ids": ref["position_ids"] if first else None,
           "labels": ref["labels"] if last else None, "loss_mask": ref["loss_mask"] if last else None,
           "attention_mask": ref["attention_mask"] if form in ("import", "function", "pre_4103") else None,
           "padding_mask": None, "cu_q": None, "cu_q_padded": None, "max_seqlen": None}  # fmt: skip
    if packed:
        padded = ref["cu_seqlens_padded"]
        out["cu_q"] = padded if form in ("import", "function") and padded else ref["cu_seqlens"]
        out["cu_q_padded"] = padded if form != "pre_4103" or first or last else None
        out["max_seqlen"] = ref["max_seqlen"]
        if form.startswith("bridge") and "padding_mask" in ref:
            out["padding_mask"] = ref["padding_mask"]
    return out


def megatron_cases(mbs: int, pp: int) -> list[tuple[str, dict[str, Any], Any]]:
    """(name, item, Megatron-LM's args) for every kind of Megatron data."""
    sft = megatron_training.sft_args(micro_batch_size=mbs, seq_length=S,
                                     pipeline_model_parallel_size=pp)  # fmt: skip
    plain = megatron_training.sft_args(micro_batch_size=mbs, seq_length=S, sft=False,
                                       pipeline_model_parallel_size=pp,
                                       create_attention_mask_in_dataloader=True)  # fmt: skip
    return [(f"sft-minus1-mbs{mbs}", megatron_item(10 + mbs, mbs, sentinel=-1), sft),
            (f"sft-S-mbs{mbs}", megatron_item(20 + mbs, mbs, sentinel=S), sft),
            (f"padded-mbs{mbs}", padded_item(mbs), sft),
            (f"plain-mbs{mbs}", megatron_item(40 + mbs, mbs, kind="plain", mask=True), plain)]  # fmt: skip


def padded_item(mbs: int) -> dict[str, Any]:
    """Rows with cu_seqlens_padded whose real total is no inner padded boundary: flatten, which
    Megatron-LM runs after the import line, would cut cu_seqlens_padded there on a middle stage
    (docs/megatron.md; tests/unit/test_callers.py shows it)."""
    item = megatron_item(35 + mbs, mbs, kind="padded")
    ref = reference(item)
    assert ref["cu_seqlens"][-1] not in ref["cu_seqlens_padded"][1:-1]
    return item


def bridge_cases(mbs: int) -> list[tuple[str, dict[str, Any]]]:
    return [(f"bridge-mbs{mbs}", bridge_item(50 + mbs, mbs)),
            (f"bridge-unpadded-mbs{mbs}", bridge_item(60 + mbs, mbs, padded=False)),
            (f"bridge-legacy-mbs{mbs}", bridge_item(70 + mbs, mbs, legacy=True)),
            (f"plain-mbs{mbs}", megatron_item(80 + mbs, mbs, kind="plain"))]  # fmt: skip


def run_forms(tp: int, pp: int) -> dict[str, Any]:
    """Every caller form after its guide line, on this rank; what Megatron's own path gave."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(tp, pp)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    source = ps.get_tensor_model_parallel_rank() == 0
    checked = 0
    callers = {form: load(module, guide_lines(LINES[form])) for form, module in
               (("import", "pretrain_gpt"), ("function", "pretrain_gpt"),
                ("pre_4103", "pretrain_gpt_pre_4103"), ("bridge_step", "bridge"),
                ("bridge_recipe", "bridge"))}  # fmt: skip
    pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp"])
    cfg = SimpleNamespace(model=SimpleNamespace(pipeline_model_parallel_size=pp),
                          dataset=SimpleNamespace(enable_offline_packing=True))  # fmt: skip
    for mbs in (1, 2):
        for name, item, args in megatron_cases(mbs, pp):

            def data(it: dict[str, Any] = item) -> Any:
                return iter([dict(it)]) if source else None  # TP rank 0 reads

            with megatron_training.using(args):
                for form in ("import", "function"):
                    got = callers[form].forward_inputs(data(), None)
                    got = view(got["tokens"], got["position_ids"], got["labels"],
                               got["loss_mask"], got["attention_mask"], got["packed_seq_params"])  # fmt: skip
                    assert got == expected(item, first, last, form), (form, name)
                    checked += 1
                tokens, labels, loss_mask, mask, positions, params = callers["pre_4103"].get_batch(
                    data(), None
                )
                got = view(tokens, positions, labels, loss_mask, mask, params)
                assert got == expected(item, first, last, "pre_4103"), ("pre_4103", name)
                checked += 1
        for name, item in bridge_cases(mbs):
            args = (cfg, False)
            step = callers["bridge_step"].forward_inputs(iter([item]), *args, pg_collection=pg)
            got = view(step["input_ids"], step["position_ids"], step["labels"], step["loss_mask"],
                       step["attention_mask"], step.get("packed_seq_params"), step.get("padding_mask"))  # fmt: skip
            assert got == expected(item, first, last, "bridge_step"), ("bridge_step", name)
            recipe = callers["bridge_recipe"].recipe_inputs(iter([item]), *args, pg_collection=pg)
            got = view(recipe["tokens"], recipe["position_ids"], recipe["labels"],
                       recipe["loss_mask"], recipe["attention_mask"],
                       recipe.get("packed_seq_params"), recipe.get("padding_mask"))  # fmt: skip
            want = expected(item, first, last, "bridge_recipe")
            if not (first or last) and want["cu_q"] is None:  # the TP form has no early return
                want = view(None, None, None, None, None, None)
            assert got == want, ("bridge_recipe", name)
            checked += 2
    mtp_item = bridge_item(55, 1)  # use_mtp: the last stage embeds too (Bridge's rule, no layout)
    for form in ("bridge_step", "bridge_recipe"):
        step = callers[form]
        run = step.forward_inputs if form == "bridge_step" else step.recipe_inputs
        got = run(iter([mtp_item]), cfg, True, pg_collection=pg)
        tokens = got["input_ids"] if form == "bridge_step" else got["tokens"]
        assert (tokens is not None) == (first or last), form
        assert tokens is None or tokens.tolist() == reference(mtp_item)["tokens"], form
        assert (got["labels"] is not None) == last, form
        checked += 1
    errors = check_errors(callers["import"], tp, pp, source)
    own = megatron_own(pp, source) if megatron_core.NEW else None
    dist.barrier()  # leave together
    return {"checked": checked, "errors": errors, "own": own, "first": first, "last": last}


def megatron_keywords(**overrides: Any) -> dict[str, Any]:
    from megatron.core import parallel_state as mpu

    kw = dict(broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
              broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=True,
              is_hybrid_cp=False, create_attention_mask_in_dataloader=False, cp_size=1,
              tp_rank=mpu.get_tensor_model_parallel_rank(), micro_batch_size=2, seq_length=S,
              mtp_on_this_rank=False,
              pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
              is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
              is_pipeline_last_stage=mpu.is_pipeline_last_stage())  # fmt: skip
    return {**kw, **overrides}


def check_errors(caller: Any, tp: int, pp: int, source: bool) -> list[str]:
    """The refusal, a bad batch and a wrong tp_rank, on this rank; what each raised."""
    call = caller.get_batch_on_this_tp_rank  # megapack's, after the guide's line
    item = megatron_item(90, 2)
    seen = []
    with pytest.raises(ValueError) as refused:
        call(dict(item) if source else {}, **megatron_keywords(is_hybrid_cp=True))
    assert str(refused.value) == HYBRID
    seen.append("hybrid")
    bad = megatron_keywords(micro_batch_size=1)  # the batch holds 2 rows
    with pytest.raises(ValueError if source else RemoteDataError) as wrong:
        call(dict(item) if source else {}, **bad)
    assert "batch['tokens'] has shape (2, 16) but micro_batch_size=1, seq_length=16" in str(
        wrong.value
    )
    seen.append(type(wrong.value).__name__)
    if tp > 1:  # TP rank 1 says it is TP rank 0: its own error, after the frame arrived
        me = megatron_keywords(tp_rank=0)
        if source:
            out = call(dict(item), **me)
            assert out["cu_seqlens"].tolist() == [reference(item)["cu_seqlens"]]
        else:
            with pytest.raises(ValueError, match=r"tp_rank=0 but global rank \d+ is TP rank 1"):
                call({}, **me)
        seen.append("tp_rank")
    out = call(dict(item) if source else {}, **megatron_keywords())  # nothing was lost
    assert out["cu_seqlens"].tolist() == [reference(item)["cu_seqlens"]]
    return seen


def megatron_own(pp: int, source: bool) -> list[int] | None:
    """Megatron's own function in the same pretrain_gpt (no guide line): this stage's cu_seqlens."""
    caller = load("pretrain_gpt")
    item = megatron_item(11, 2, sentinel=-1)
    args = megatron_training.sft_args(
        micro_batch_size=2, seq_length=S, pipeline_model_parallel_size=pp
    )
    with megatron_training.using(args):
        params = caller.forward_inputs(iter([dict(item)]) if source else None, None)[
            "packed_seq_params"
        ]
    return params.cu_seqlens_q.tolist()


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g.id)
def test_each_caller_form_after_its_guide_line(dist_pool: Any, grid: Grid) -> None:
    results = dist_pool.run(run_forms, grid.world_size, grid.tp, grid.pp, timeout=240)
    assert all(r["checked"] == 2 * (4 * 3 + 4 * 2) + 2 for r in results)
    sources = ["ValueError"] * grid.pp
    assert [r["errors"][1] for r in results if r["errors"][1] == "ValueError"] == sources
    assert all(("tp_rank" in r["errors"]) == (grid.tp > 1) for r in results)
    if megatron_core.NEW:  # Megatron's own path: its middle stages keep a -1
        reference_cu = reference(megatron_item(11, 2, sentinel=-1))["cu_seqlens"]
        for r in results:
            middle = not (r["first"] or r["last"])
            assert (r["own"] == reference_cu) != middle, r["own"]
            assert not middle or -1 in r["own"]


def run_padded_cut() -> dict[str, Any]:
    """tp 1 x pp 3: rows whose real total (28) is an inner padded boundary, through each line."""
    from megatron.core import parallel_state as ps

    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(1, 3)
    item = megatron_item(32, 2, kind="padded")
    args = megatron_training.sft_args(
        micro_batch_size=2, seq_length=S, pipeline_model_parallel_size=3
    )
    got = {}
    with megatron_training.using(args):
        for form in ("import", "function"):
            caller = load("pretrain_gpt", guide_lines(LINES[form]))
            params = caller.forward_inputs(iter([dict(item)]), None)["packed_seq_params"]
            got[form] = params.cu_seqlens_q_padded.tolist()
    dist.barrier()
    return {"middle": ps.get_pipeline_model_parallel_rank() == 1, **got}


def test_the_function_line_keeps_what_flatten_cuts_on_a_middle_stage(dist_pool: Any) -> None:
    want = reference(megatron_item(32, 2, kind="padded"))["cu_seqlens_padded"]
    cut = want[: want.index(28) + 1]
    for r in dist_pool.run(run_padded_cut, 3, timeout=120):
        assert r["function"] == want
        assert r["import"] == (cut if r["middle"] else want)  # flatten runs after the import line


def run_cp_share() -> list[tuple[str, list[Any], list[Any]]]:
    """tp 1 x cp 2: what each caller's model gets on this CP rank, and the zigzag reference."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megapack.harness.megatron_cpu import megatron_on_cpu

    megatron_on_cpu()
    ps.initialize_model_parallel(1, 1, context_parallel_size=2)
    rank, out = ps.get_context_parallel_rank(), []
    sft = megatron_item(41, 2, step=4)
    masking = megatron_item(42, 2)
    cases = (("function", sft, {"sft": True}, "document"),
             ("function", masking, {"sft": False, "dataloader_inter_document_masking": True}, "row"),
             ("import", masking, {"sft": False, "dataloader_inter_document_masking": True}, "row"))  # fmt: skip
    for form, item, flags, layout in cases:
        args = megatron_training.sft_args(micro_batch_size=2, seq_length=S, context_parallel_size=2,
                                          **flags)  # fmt: skip
        with megatron_training.using(args):
            got = load("pretrain_gpt", guide_lines(LINES[form])).forward_inputs(iter([dict(item)]))
        ref = reference(item)
        spans = ref["cu_seqlens"] if layout == "document" else [0, 2 * S]
        for key in ("tokens", "labels", "position_ids"):
            out.append((f"{form}-{layout}-{key}", got[key].tolist()[0],
                        zigzag(ref[key][0], spans, 2, rank)))  # fmt: skip
        assert got["packed_seq_params"].cu_seqlens_q.tolist() == ref["cu_seqlens"]  # whole row
    pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp"])
    cfg = SimpleNamespace(model=SimpleNamespace(pipeline_model_parallel_size=1),
                          dataset=SimpleNamespace(enable_offline_packing=True))  # fmt: skip
    step = load("bridge", guide_lines(LINES["bridge_step"]))
    packed, plain = bridge_item(43, 1, step=4), megatron_item(44, 2, kind="plain")
    got = step.forward_inputs(iter([packed]), cfg, False, pg_collection=pg)
    ref = reference(packed)
    for key, have in (("tokens", got["input_ids"]), ("padding_mask", got["padding_mask"])):
        out.append((f"bridge-{key}", have.tolist()[0],
                    zigzag(ref[key][0], ref["cu_seqlens_padded"], 2, rank)))  # fmt: skip
    got = step.forward_inputs(iter([plain]), cfg, False, pg_collection=pg)
    out.append(("bridge-plain", got["input_ids"].tolist(),
                [zigzag(row, [0, S], 2, rank) for row in plain["tokens"].tolist()]))  # fmt: skip
    dist.barrier()
    return out


def test_the_function_lines_take_the_cp_share(dist_pool: Any) -> None:
    for rank_cases in dist_pool.run(run_cp_share, 2, timeout=120):
        for name, got, want in rank_cases:
            assert got == want, name
