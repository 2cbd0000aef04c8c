"""What a captured step refuses and clears (`megapack.megatron.graph_parts`), function by function.

Every refused megatron-core config field named with its value, reason and fix, on duck-typed
configs and on megatron-core's own ``TransformerConfig`` of the installed release (whose defaults
must pass); the hooks cleared for a capture and restored, an error included; the CUDA backend of
a backend config; the attention a capture cannot hold (a PackedAttention whose backend resolves
to one that reads the host, Transformer Engine's on padded boundaries without
``pad_between_seqs``), with backends faked where CPU cannot resolve them. GraphStep calling
these is checked in tests/functional/test_graph_step_refusals.py, the real capture on a GPU in
tests/functional/test_graph_step_capture.py.
"""

from __future__ import annotations

import dataclasses
import doctest
import re
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from megapack.attention import PackedAttention
from megapack.attention import choice as attention_choice
from megapack.core.buckets import BUCKET_NAMES
from megapack.core.seq_params import BUCKETS_ATTR, make_packed_seq_params
from megapack.megatron import graph_parts
from megapack.megatron.graph_parts import (
    CLEARED_FOR_CAPTURE,
    REFUSED,
    check_capture_attention,
    check_config,
    check_te_padding,
    check_tp_backend,
    cuda_backend,
    hooks_cleared,
)

REFUSED_VALUE: dict[str, Any] = {
    "grad_scale_func": lambda loss: loss * 1024.0,
    "no_sync_func": lambda: None,
    "gradient_accumulation_fusion": True,
    "hybrid_context_parallel": True,
    "cuda_graph_impl": "local",
    "enable_cuda_graph": True,
    "external_cuda_graph": True,
    "num_moe_experts": 8,
    "overlap_moe_expert_parallel_comm": True,
    "moe_paged_stash": True,
    "mtp_num_layers": 1,
    "recompute_granularity": "full",
    "cpu_offloading": True,
    "fine_grained_activation_offloading": True,
}
"""A value each refused field is refused with (a test below checks every field has one)."""

BOTH_MODES = {"grad_scale_func", "no_sync_func", "gradient_accumulation_fusion",
              "hybrid_context_parallel"}  # fmt: skip
"""The fields refused in eager mode too: GraphStep's own update cannot honour them."""


def test_module_examples() -> None:
    assert doctest.testmod(graph_parts).failed == 0


def test_the_named_hooks_and_configurations_are_refused_or_cleared() -> None:
    # the list: sync/capture hooks refused or cleared, configurations that cannot capture
    refused = {r.field for r in REFUSED}
    assert {"grad_scale_func", "no_sync_func", "cuda_graph_impl", "enable_cuda_graph",
            "num_moe_experts", "recompute_granularity"} <= refused  # fmt: skip
    assert CLEARED_FOR_CAPTURE == ("timers",) and "timers" not in refused
    assert set(REFUSED_VALUE) == refused
    assert {r.field for r in REFUSED if not r.graph_only} == BOTH_MODES


@pytest.mark.parametrize("refusal", REFUSED, ids=lambda r: r.field)
def test_every_refused_field_is_named_with_its_value_reason_and_fix(refusal: Any) -> None:
    config = SimpleNamespace(**{refusal.field: REFUSED_VALUE[refusal.field]})
    shown = (
        "<lambda>" if callable(REFUSED_VALUE[refusal.field]) else repr(REFUSED_VALUE[refusal.field])
    )
    doing = "capture a step" if refusal.graph_only else "run a step"
    message = (f"GraphStep cannot {doing} with the model config's {refusal.field}={shown}: "
               f"{refusal.because}; {refusal.fix}")  # fmt: skip
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_config(config, graph=True)
    if refusal.graph_only:
        check_config(config, graph=False)  # eager runs it: no capture
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_config(config, graph=False)


@pytest.mark.parametrize("value", [None, False, 0, "none"])
def test_an_unset_field_or_one_the_release_lacks_is_not_refused(value: Any) -> None:
    check_config(SimpleNamespace(), graph=True)
    check_config(SimpleNamespace(**dict.fromkeys(REFUSED_VALUE, value)), graph=True)


def test_the_installed_megatron_cores_default_config_passes_and_its_fields_are_refused() -> None:
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    check_config(config, graph=True)  # the defaults of this release are never refused
    present = [r for r in REFUSED if hasattr(config, r.field)]
    # both releases have all but moe_paged_stash (0.19 only): the table reads real field names
    assert len(present) >= len(REFUSED) - 1, [r.field for r in REFUSED if r not in present]
    for refusal in present:
        saved = getattr(config, refusal.field)
        setattr(config, refusal.field, REFUSED_VALUE[refusal.field])
        try:
            with pytest.raises(ValueError, match=f"model config's {refusal.field}="):
                check_config(config, graph=True)
        finally:
            setattr(config, refusal.field, saved)


class _Timers:
    """megatron-core's ``Timers`` as the schedule calls it: ``timers(name, log_level=)``."""

    def __call__(self, name: str, log_level: int = 0) -> Any:
        raise AssertionError("not called here")


def test_timers_are_none_during_the_capture_and_restored_after_even_on_an_error() -> None:
    timers = _Timers()
    config = SimpleNamespace(timers=timers, grad_scale_func=None)
    with hooks_cleared(config):
        assert config.timers is None
    assert config.timers is timers
    with pytest.raises(RuntimeError, match="capture failed"), hooks_cleared(config):
        assert config.timers is None
        raise RuntimeError("capture failed")
    assert config.timers is timers
    unset = SimpleNamespace(timers=None)
    with hooks_cleared(unset):
        assert unset.timers is None
    assert unset.timers is None and vars(unset) == {"timers": None}
    with hooks_cleared(SimpleNamespace()):  # a config without the hook: nothing to clear
        pass


@pytest.mark.parametrize(
    ("config", "backend"),
    [("cpu:gloo,cuda:nccl", "nccl"), ("cuda:nccl", "nccl"), ("nccl", "nccl"),
     ("cpu:gloo,cuda:gloo", "gloo"), ("gloo", "gloo"), ("cpu:gloo", None)],
)  # fmt: skip
def test_the_cuda_backend_of_a_backend_config(
    monkeypatch: pytest.MonkeyPatch, config: str, backend: str | None
) -> None:
    monkeypatch.setattr(graph_parts.dist, "get_backend_config", lambda group: config)
    assert cuda_backend(object()) == (backend, config)


def test_the_tp_group_checked_is_the_models_own_else_parallel_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core import parallel_state as ps

    configs = {"model's": "cpu:gloo,cuda:nccl", "parallel_state's": "cpu:gloo,cuda:gloo"}
    monkeypatch.setattr(graph_parts.dist, "get_backend_config", lambda group: configs[group])
    monkeypatch.setattr(ps, "get_tensor_model_parallel_group", lambda: "parallel_state's")
    inner = torch.nn.Module()
    inner.tp_group = "model's"  # megatron-core's language models keep the group they reduce over
    wrapped = SimpleNamespace(module=inner)  # as Float16Module wraps the GPT
    check_tp_backend(wrapped)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"runs CUDA tensors on 'gloo' \(backend config "
                       r"'cpu:gloo,cuda:gloo'\); a CUDA graph holds NCCL collectives only"):  # fmt: skip
        check_tp_backend(torch.nn.Linear(2, 2))  # no tp_group anywhere: parallel_state's


# ------------------------------------------------------------------ the attention a capture holds


class _One:
    def size(self) -> int:
        return 1


def attention(backend: str) -> PackedAttention:
    config = SimpleNamespace(num_attention_heads=2, num_query_groups=2, kv_channels=4,
                             attention_dropout=0.0)  # fmt: skip
    return PackedAttention(config, 1, None, "self", backend=backend,
                           pg_collection=SimpleNamespace(tp=_One()))  # fmt: skip


def model_of(*layers: torch.nn.Module) -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"core_attention": a}) for a in layers)
    return model


def batch(*, padded: bool = False, planned: bool = False) -> dict[str, Any]:
    cu = torch.tensor([0, 3, 8, 16, 16], dtype=torch.int32)
    cu_padded = torch.tensor([0, 4, 8, 16, 16], dtype=torch.int32) if padded else None
    buckets = (torch.zeros(3, 8, dtype=torch.int32),) if planned else None
    params = make_packed_seq_params(cu, cu_padded, 16, buckets=buckets)
    return {"cu_seqlens": cu, "cu_seqlens_padded": cu_padded, "max_seqlen": 16,
            "packed_seq_params": params}  # fmt: skip


def check(model: torch.nn.Module, b: dict[str, Any]) -> None:
    check_capture_attention(model, b, device=torch.device("cpu"), dtype=torch.float32)


def resolving_to(monkeypatch: pytest.MonkeyPatch, name: str) -> list[dict[str, Any]]:
    """Make every backend resolve to ``name`` (what a GPU would resolve), recording the calls."""
    calls: list[dict[str, Any]] = []

    def resolve(backend: str, device: Any, **kwargs: Any) -> str:
        calls.append({"backend": backend, "device": device, **kwargs})
        return name

    monkeypatch.setattr(attention_choice, "resolve_backend", resolve)
    return calls


def test_an_attention_that_reads_the_host_is_refused_naming_the_layer_and_backend() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape("GraphStep cannot capture layers.0.core_attention (PackedAttention "
                        "backend='sdpa'): it runs 'sdpa' (forced), and it loops over the "
                        "documents with their boundaries read on the host; give the layer spec "
                        "a capturable backend"),
    ):  # fmt: skip
        check(model_of(attention("sdpa")), batch())
    # auto resolves as the layer would: bucketed on CPU (the first attention is layer 1 here)
    with pytest.raises(ValueError, match=r"layers.1.core_attention \(PackedAttention backend="
                       r"'auto'\): it runs 'bucketed' \(auto's choice\), and its bucket shapes "
                       r"change with every micro-batch; .*torch_varlen, flex\)$"):  # fmt: skip
        check(model_of(torch.nn.Identity(), attention("auto")), batch())
    with pytest.raises(ValueError, match=r"\(auto's choice \(the batches bring their bucket "
                       r"plan\)\).*or deliver without fields=megapack.BUCKET_FIELDS$"):  # fmt: skip
        check(model_of(attention("auto")), batch(planned=True))


def test_a_capturable_backend_passes_resolved_as_the_layer_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = resolving_to(monkeypatch, "torch_varlen")
    layer = attention("auto")
    layer.dropout = 0.1
    check(model_of(layer, attention("cudnn")), batch(planned=True, padded=True))
    assert [c["backend"] for c in calls] == ["auto", "cudnn"]
    assert calls[0] == {"backend": "auto", "device": torch.device("cpu"), "training": True,
                        "dropout": 0.1, "dtype": torch.float32, "planned": True}  # fmt: skip
    layer.eval()  # no dropout outside training, as PackedAttention.forward
    check(model_of(layer), batch())
    assert calls[-1]["dropout"] == 0.0 and calls[-1]["planned"] is False


WITH = frozenset({"cu_seqlens_q", "pad_between_seqs"})
"""``PackedSeqParams`` fields of a release with ``pad_between_seqs`` (megatron-core 0.19)."""
WITHOUT = frozenset({"cu_seqlens_q"})
"""... and of one without it (megatron-core 0.16.1)."""


def test_transformer_engine_on_padded_boundaries_needs_pad_between_seqs_set() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "GraphStep cannot capture Transformer Engine's attention (layer 3) on padded "
            "boundaries (the batches carry cu_seqlens_padded) with this megatron-core: its "
            "PackedSeqParams has no pad_between_seqs (megatron-core 0.19 has it)")):  # fmt: skip
        check_te_padding("layer 3", SimpleNamespace(), fields=WITHOUT)
    for value in (None, False):
        with pytest.raises(ValueError, match=re.escape(
                f"(layer 3) on padded boundaries with packed_seq_params.pad_between_seqs={value}: "
                "TE then compares cu_seqlens_padded with cu_seqlens on the host")):  # fmt: skip
            check_te_padding("layer 3", SimpleNamespace(pad_between_seqs=value), fields=WITH)
    check_te_padding("layer 3", SimpleNamespace(pad_between_seqs=True), fields=WITH)
    # the default: the installed release's fields, from megapack's one place for them
    from megapack.core.megatron_release import megatron_release

    params = batch(padded=True)["packed_seq_params"]
    if "pad_between_seqs" in megatron_release().packed_seq_fields:
        check_te_padding("layer 3", params)  # make_packed_seq_params set it for padded bounds
    else:
        with pytest.raises(ValueError, match="has no pad_between_seqs"):
            check_te_padding("layer 3", params)


def test_megapacks_te_backend_is_checked_on_padded_boundaries_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resolving_to(monkeypatch, "te")
    model = model_of(attention("auto"))
    check(model, batch())  # unpadded: TE compares a tensor with itself, no host read
    padded = batch(padded=True)
    has_field = "pad_between_seqs" in {
        f.name for f in dataclasses.fields(padded["packed_seq_params"])
    }
    if not has_field:  # megatron-core 0.16.1
        with pytest.raises(ValueError, match=r"\(layers.0.core_attention\) on padded boundaries "
                           r".* has no pad_between_seqs"):  # fmt: skip
            check(model, padded)
    else:  # 0.19: refused unless True
        padded["packed_seq_params"].pad_between_seqs = None
        with pytest.raises(ValueError, match="pad_between_seqs=None"):
            check(model, padded)
        padded["packed_seq_params"].pad_between_seqs = True
        check(model, padded)


def test_megatron_cores_own_te_attention_is_found_by_its_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = ModuleType("transformer_engine.pytorch")

    class DotProductAttention(torch.nn.Module):
        pass

    class TEDotProductAttention(DotProductAttention):  # megatron-core's subclass
        pass

    te.DotProductAttention = DotProductAttention  # type: ignore[attr-defined]
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), TEDotProductAttention())
    padded = batch(padded=True)
    padded["packed_seq_params"] = SimpleNamespace(pad_between_seqs=None)  # refused on either line
    check(model, padded)  # TE not imported: no TE attention to find
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    with pytest.raises(ValueError, match=r"attention \(1\) on padded boundaries"):
        check(model, padded)
    check(model, batch())  # unpadded


def test_the_bucket_plan_is_read_from_the_batchs_params(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = resolving_to(monkeypatch, "cudnn")
    planned = batch()
    setattr(planned["packed_seq_params"], BUCKETS_ATTR, ())  # a plan with no bucket still is one
    check(model_of(attention("auto")), planned)
    check(model_of(attention("auto")), batch())
    assert [c["planned"] for c in calls] == [True, False]
    assert BUCKET_NAMES[0] not in planned  # the params decide, as in Documents.from_params
