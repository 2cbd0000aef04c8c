"""docs/megatron.md's snippets run against the re-created callers, on test_docs' one-rank world
(gloo, megatron-core's ``parallel_state`` at tp = pp = 1): each harness loads a caller's
re-creation into the snippet's namespace, runs the snippet (the guide's line lands after the
caller's code, as added after its imports or its ``def get_batch``), then runs the caller and
checks what it hands its model against `data.reference`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tests.functional.callers import HERE, megatron_training
from tests.functional.callers.data import S, bridge_item, megatron_item, reference


def _caller(ns: dict[str, Any], name: str) -> None:
    path = HERE / f"{name}.py"
    exec(compile(path.read_text(), str(path), "exec"), ns)


def _check(got: dict[str, Any], want: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = got[key]
        value = value.float().tolist() if key == "loss_mask" else value.tolist()
        assert value == want[key], f"{key}: {value} != {want[key]}"


def _pg() -> SimpleNamespace:
    world = dist.group.WORLD
    return SimpleNamespace(tp=world, pp=world, cp=world)


def _cfg() -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(pipeline_model_parallel_size=1),
                           dataset=SimpleNamespace(enable_offline_packing=True))  # fmt: skip


def megatron_main_import(ns: dict[str, Any], run: Callable[[], None]) -> None:
    _caller(ns, "pretrain_gpt")
    run()
    _check_main(ns)


def _check_main(ns: dict[str, Any]) -> None:
    item = megatron_item(1, 2, sentinel=-1)
    with megatron_training.using(megatron_training.sft_args(micro_batch_size=2, seq_length=S)):
        got = ns["forward_inputs"](iter([item]), None)
    want = reference(item)
    _check(got, want, ("tokens", "labels", "loss_mask", "position_ids"))
    params = got["packed_seq_params"]
    assert params.cu_seqlens_q.tolist() == want["cu_seqlens"], params
    assert params.max_seqlen_q == want["max_seqlen"]


def megatron_main_function(ns: dict[str, Any], run: Callable[[], None]) -> None:
    _caller(ns, "pretrain_gpt")
    run()
    assert ns["get_batch"].__module__ == "megapack.delivery.callers"
    _check_main(ns)  # the same checks, through the replacement


def megatron_middle(ns: dict[str, Any], run: Callable[[], None]) -> None:
    import megapack
    from tests.functional.callers.megatron_core import flatten_batch_for_packed_sequences

    ns.update(torch=torch, megapack=megapack, tp_group=dist.group.WORLD,
              get_batch_on_this_tp_rank=megapack.get_batch_on_this_tp_rank,
              flatten_batch_for_packed_sequences=flatten_batch_for_packed_sequences)  # fmt: skip
    run()
    assert ns["megatron"]["cu_seqlens"].tolist() == [[0, 3, 4, -1, 3, -2]]
    assert ns["batch"]["cu_seqlens"].tolist() == [[0, 3, 4, 8]]
    assert ns["batch"]["tokens"] is None and ns["batch"]["max_seqlen"].tolist() == [4]


def megatron_pre_4103(ns: dict[str, Any], run: Callable[[], None]) -> None:
    _caller(ns, "pretrain_gpt_pre_4103")
    run()
    item = megatron_item(2, 2, sentinel=S)
    with megatron_training.using(megatron_training.sft_args()):
        tokens, labels, loss_mask, attention_mask, position_ids, params = ns["get_batch"](
            iter([item]), None
        )
    want = reference(item)
    _check({"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids}, want, ("tokens", "labels", "loss_mask", "position_ids"))  # fmt: skip
    assert attention_mask is None and params.cu_seqlens_q.tolist() == want["cu_seqlens"]


def bridge_step(ns: dict[str, Any], run: Callable[[], None]) -> None:
    _caller(ns, "bridge")
    run()
    item = bridge_item(3, 1)
    got = ns["forward_inputs"](iter([item]), _cfg(), False, pg_collection=_pg())
    want = reference(item)
    _check(
        {**got, "tokens": got["input_ids"]}, want, ("tokens", "labels", "loss_mask", "position_ids")
    )
    params = got["packed_seq_params"]
    assert params.cu_seqlens_q.tolist() == want["cu_seqlens"]
    assert params.cu_seqlens_q_padded.tolist() == want["cu_seqlens_padded"]
    assert got["padding_mask"].tolist() == want["padding_mask"]


def bridge_recipe(ns: dict[str, Any], run: Callable[[], None]) -> None:
    _caller(ns, "bridge")
    run()
    item = bridge_item(4, 2, legacy=True)
    got = ns["recipe_inputs"](iter([item]), _cfg(), False, pg_collection=_pg())
    want = reference(item)
    _check(got, want, ("tokens", "labels", "loss_mask", "position_ids"))
    assert got["packed_seq_params"].cu_seqlens_q.tolist() == want["cu_seqlens"]
    assert got["padding_mask"] is None  # the older keys carry none


def pg_collection(ns: dict[str, Any], run: Callable[[], None]) -> None:
    import megapack

    item = megatron_item(5, 2)
    ns.update(megapack=megapack, data_iterator=iter([item]), pg_collection=_pg(), vp_stage=None,
              vp_size=None)  # fmt: skip
    run()
    assert ns["batch"]["cu_seqlens"].tolist() == reference(item)["cu_seqlens"]
    assert ns["topology"].tp_ranks == (0,) and ns["topology"].pp_size == 1


def gpt_model_from_folder(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack.cli import main

    here = Path.cwd()  # other snippets save a "packed/" of their own there: pack in a fresh folder
    os.chdir(tempfile.mkdtemp(dir=here))
    try:  # the guide's own `megapack pack sft.jsonl --seq-len 256 --out packed/`
        assert main(["pack", str(here / "sft.jsonl"), "--seq-len", "256", "--out", "packed"]) == 0
        _model_from_folder(ns, run)
    finally:
        os.chdir(here)


def _model_from_folder(ns: dict[str, Any], run: Callable[[], None]) -> None:
    from megapack.data import PackedDataset

    class GPTModel:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs

    ns.update(PackedDataset=PackedDataset, GPTModel=GPTModel, config=object(), layer_spec=object(),
              tp=2)  # fmt: skip
    run()
    assert ns["vocab"] == 259 and ns["model"].kwargs["vocab_size"] == 512
    assert ns["model"].kwargs["max_sequence_length"] == 512


HARNESSES: dict[str, Callable[[dict[str, Any], Callable[[], None]], None]] = {
    "(Megatron-LM main): one line after its imports": megatron_main_import,
    "(Megatron-LM main): or one line after its def get_batch": megatron_main_function,
    "# A middle stage (pp_rank 1 of 3) of an --sft run": megatron_middle,
    "(Megatron-LM before PR #4103): the same one line": megatron_pre_4103,
    "in place of: from megatron.bridge.training.gpt_step import get_batch": bridge_step,
    "in place of: from megatron.bridge.training.utils.batch_utils": bridge_recipe,
    "Topology.from_pg_collection(pg_collection, vp_stage": pg_collection,
    'vocab = train.meta["vocab_size"]': gpt_model_from_folder,
}
"""docs/megatron.md's snippets (a unique fragment of each) -> their harness."""
