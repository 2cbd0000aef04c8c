"""The GPU kit on torch 2.11 and in sections, on CPU: the profile without ``is_python_function``,
a kernel that cannot compile reported as that (not as a sync), the sync target, the cuDNN
versions in the header, the sections, their estimates, the split into two runs, the first-run
plan and its default backend."""

from __future__ import annotations

import doctest
import importlib.machinery
import sys
import types
from types import SimpleNamespace as E
from typing import Any

import pytest
import torch

from megapack.bench.gpu import compile_failure as compile_module
from megapack.bench.gpu import devices, kit, profile
from megapack.bench.gpu.compile_failure import compile_failure
from megapack.bench.gpu.kit import (
    GUESSED,
    KIT,
    PLANS,
    RUNNERS,
    SECTIONS,
    SPLIT,
    default_backend,
    estimate_s,
    listing,
    parse_sections,
)
from megapack.bench.gpu.profile import is_python_function, summarize_events
from megapack.bench.gpu.report import Check
from megapack.bench.gpu.sizes import FIRST_RUN_S, KIT_TARGET_S
from megapack.bench.gpu.syncs import SYNC_TARGET, _guarded, sync_target

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "module", [compile_module, devices, kit, profile], ids=lambda m: m.__name__
)
def test_docstring_examples(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0


# -- the profile on torch 2.11: no is_python_function, no Python events, operators with a stack ---
def event(name: str, us: float, parent: Any = None, **extra: Any) -> E:
    """A profiled event as torch 2.11 makes it: no ``is_python_function`` attribute."""
    return E(name=name, thread=1, self_cpu_time_total=us, cpu_parent=parent, device_type="DeviceType.CPU", **extra)  # fmt: skip


def test_profile_reads_torch_2_11_events_without_is_python_function() -> None:
    matmul = event("aten::matmul", 100.0, stack=["torch/nn/functional.py(9): linear",
                   "megatron/core/tensor_parallel/layers.py(40): forward"])  # fmt: skip
    mm = event("aten::mm", 300.0, parent=matmul)  # no stack of its own: its parent's counts
    sdpa = event("aten::_scaled_dot_product_flash_attention_for_cpu", 200.0,
                 stack=["megapack/attention/kernels.py(50): sdpa", "megapack/harness/gpt.py(7): forward_step"])  # fmt: skip
    step = event("aten::add_", 50.0, stack=["torch/optim/sgd.py(30): step", "megapack/bench/gpu/throughput.py(1): train_step"])  # fmt: skip
    started = event("aten::zeros", 900.0, stack=["torch/profiler/profiler.py(1): start"])  # fmt: skip
    assert not any(hasattr(e, "is_python_function") for e in (matmul, mm, sdpa, step))
    out = summarize_events([matmul, mm, sdpa, step, started], host_ms=1.0, cuda=False)
    assert out["by_owner_ms"] == pytest.approx({"megapack": 0.2, "megatron": 0.4, "torch": 0.05})
    assert [name for name, _ in out["top"]][:2] == [
        "aten::zeros",
        "aten::mm",
    ]  # the ops by self time
    assert out["device_ms"] is None and out["host_ms"] == 1.0


def test_profile_reads_torch_2_13_events_with_python_functions() -> None:
    frame = event("megapack/attention/kernels.py(50): sdpa", 10.0, is_python_function=True)
    op = event("aten::bmm", 40.0, parent=frame, is_python_function=False)
    builtin = event("<built-in method sum of Tensor object at 0x1>", 5.0)  # no flag: by its name
    out = summarize_events([frame, op, builtin], host_ms=1.0, cuda=False)
    assert out["by_owner_ms"] == pytest.approx({"megapack": 0.05, "megatron": 0.0, "torch": 0.005})
    assert [name for name, _ in out["top"]] == ["aten::bmm"]  # Python frames are not operators
    assert is_python_function(event("x.py(3): f", 1.0)) and not is_python_function(op)


# -- a kernel that cannot compile here ------------------------------------------------------------
def inductor_error(name: str, message: str) -> type[Exception]:
    return type(name, (RuntimeError,), {"__module__": "torch._inductor.exc"})


def test_compile_failures_are_named_and_bugs_are_not() -> None:
    no_choice = inductor_error("NoValidChoicesError", "No choices to select\nmore")
    try:
        try:
            raise no_choice("No choices to select\nmore")
        except RuntimeError as inner:
            wrapper = type(
                "BackendCompilerFailed", (RuntimeError,), {"__module__": "torch._dynamo.exc"}
            )
            raise wrapper("backend='inductor' raised: ...") from inner
    except RuntimeError as outer:
        assert (
            compile_failure(outer)
            == "cannot compile here: NoValidChoicesError: No choices to select"
        )
    lowering = inductor_error("SomethingElse", "")
    assert compile_failure(lowering("boom")) == "cannot compile here: SomethingElse: boom"
    traced = type("TorchRuntimeError", (RuntimeError,), {"__module__": "torch._dynamo.exc"})
    assert compile_failure(traced("shape mismatch")) is None  # a bug met while tracing
    assert compile_failure(ValueError("bad")) is None


def test_a_backend_that_cannot_compile_is_skipped_not_a_sync_failure() -> None:
    def flex() -> None:
        raise inductor_error("NoValidChoicesError", "")("No choices to select, consider ATEN")

    def broken() -> None:
        raise TypeError("a real bug")

    label = "sync: attention flex, bfloat16, fwd+bwd"
    skipped = _guarded(label, flex, flex, CPU, stand_in_guard)
    assert (skipped.status, skipped.detail) == (
        "skipped", "cannot compile here: NoValidChoicesError: No choices to select, consider ATEN")  # fmt: skip
    failed = _guarded(label, broken, broken, CPU, stand_in_guard)
    assert failed.status == "failed" and failed.detail.startswith(
        "warm-up failed: TypeError: a real bug"
    )


def stand_in_guard(device: torch.device) -> Any:
    import contextlib

    @contextlib.contextmanager
    def guard() -> Any:
        yield True

    return guard()


def test_the_sync_target_counts_failures_not_compile_skips() -> None:
    control = Check(name="sync: positive control (a planted .item() must trip the detector)",
                    status="passed", detail="the planted .item() raised")  # fmt: skip
    ok = Check(name="sync: whole step", status="passed", detail="0 synchronizing CUDA calls")
    flex = Check(name="sync: attention flex", status="skipped", detail="cannot compile here: X")
    target = sync_target([control, ok, flex])
    assert target.name == SYNC_TARGET and target.status == "passed"
    assert (
        target.detail
        == "2 sync checks passed; skipped: sync: attention flex (cannot compile here: X)"
    )
    bad = Check(name="sync: prefetch", status="failed", detail="RuntimeError")
    assert sync_target([control, ok, bad]).status == "failed"
    blind = Check(name=control.name, status="failed", detail="did not raise")
    assert sync_target([blind, ok]).status == "failed"
    cpu = Check(name=control.name, status="skipped", detail="needs CUDA; cpu cannot detect syncs")
    assert (sync_target([cpu]).status, sync_target([cpu]).detail) == ("skipped", cpu.detail)


# -- the header's versions ------------------------------------------------------------------------
def test_cudnn_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    frontend = types.ModuleType("cudnn")
    frontend.__spec__ = importlib.machinery.ModuleSpec("cudnn", None)
    frontend.__version__ = "1.28.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cudnn", frontend)
    assert devices.cudnn_versions() == {"cudnn": "9.19.0 (91900)", "cudnn_frontend": "1.28.0"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: frontend.__spec__)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # there, but importing it fails
    assert devices.cudnn_versions()["cudnn_frontend"].startswith("import failed: ")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert devices.cudnn_versions() == {"cudnn": "none", "cudnn_frontend": "not installed"}


# -- sections ---------------------------------------------------------------------------------------
def test_sections_parse_in_the_kits_order() -> None:
    assert parse_sections(None) == KIT  # the whole kit: the first run's sections are not in it
    assert KIT == ("attention", "losses", "syncs", "throughput", "profile", "graph")
    assert parse_sections("graph,attention") == ("attention", "graph")
    assert parse_sections("graph-launch,smoke,throughput-4k") == (
        "smoke",
        "throughput-4k",
        "graph-launch",
    )
    assert parse_sections(" throughput ,") == ("throughput",)
    with pytest.raises(
        ValueError,
        match="unknown section 'throughputs'; choose from smoke, attention, attention-rows",
    ):
        parse_sections("throughputs")
    with pytest.raises(ValueError, match="name at least one section"):
        parse_sections(",")


def test_the_whole_kit_fits_two_runs_of_six_minutes() -> None:
    flat = [s for run in SPLIT for s in run]
    assert sorted(flat) == sorted(KIT)  # every section of the kit in exactly one run
    assert all(estimate_s(run) <= KIT_TARGET_S for run in SPLIT)
    assert estimate_s(KIT) > KIT_TARGET_S  # hence the split
    assert estimate_s(("attention",)) == SECTIONS["attention"][0]  # no model for it
    assert estimate_s(("syncs",)) == SECTIONS["syncs"][0] + kit.MODEL_S
    text = listing()
    assert all(name in text for name in SECTIONS) and "--only throughput,profile" in text


def test_the_run_time_target(capsys: pytest.CaptureFixture[str]) -> None:
    one = kit._time_check(300.0, ("throughput", "profile"), True, "")
    assert (one.status, one.detail) == ("passed", "300 s for throughput, profile")
    assert kit._time_check(400.0, ("throughput",), True, "").status == "failed"
    every = kit._time_check(500.0, KIT, True, "")
    assert (
        every.status == "info" and "--only throughput,profile and --only attention" in every.detail
    )
    assert kit._time_check(5.0, ("graph",), False, "dry run").status == "skipped"
    assert kit.main(["--list"]) == 0 and "the whole kit in two runs" in capsys.readouterr().out
    assert kit.main(["--only", "speed", "--dry-run"]) == 2
    assert "unknown section 'speed'" in capsys.readouterr().err


# -- the first-run plan ------------------------------------------------------------------------------
def test_the_first_run_plan_is_one_run_of_five_minutes_in_order() -> None:
    plan = PLANS["first-run"]
    assert plan.sections == ("smoke", "attention-rows", "throughput-4k", "graph-launch")
    assert parse_sections(",".join(reversed(plan.sections))) == plan.sections  # the kit's order
    assert plan.limit_s == FIRST_RUN_S == 300.0
    # the estimate leaves room for the ~20 s start and for guesses that are too low
    assert estimate_s(plan.sections) + kit.START_S <= 0.8 * plan.limit_s
    assert set(plan.sections) <= GUESSED  # none of them has run on a GPU: their estimates say so
    assert set(RUNNERS) == set(SECTIONS)  # every section has its code
    text = listing()
    assert (
        "--plan first-run  (~195 s of its 300 s target: smoke, attention-rows, throughput-4k, graph-launch)"
        in text
    )
    assert all(f"{name:<14} ~" in text for name in SECTIONS)
    assert "smoke          ~  40 s guess" in text and "attention      ~  40 s       " in text


def test_the_first_run_time_target() -> None:
    ok = kit._time_check(290.0, PLANS["first-run"].sections, True, "", "first-run")
    assert (ok.name, ok.status) == ("target: the first-run plan within 5 minutes", "passed")
    late = kit._time_check(301.0, PLANS["first-run"].sections, True, "", "first-run")
    assert late.status == "failed" and late.detail.startswith("301 s for smoke, attention-rows")


def test_plan_and_only_are_exclusive_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert kit.main(["--plan", "first-run", "--only", "smoke", "--dry-run"]) == 2
    assert "give --plan or --only, not both" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        kit.main(["--plan", "second-run", "--dry-run"])
    assert stop.value.code == 2 and "invalid choice: 'second-run'" in capsys.readouterr().err


def test_the_first_run_trains_cudnn_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    from megapack.attention import choice

    cuda = torch.device("cuda", 0)
    assert default_backend(None, cuda, torch.bfloat16) == ("auto", "the default")
    backend, why = default_backend("first-run", CPU, torch.float32)
    assert backend == "auto" and why.endswith("cudnn is unavailable here: cudnn runs on CUDA only")
    monkeypatch.setattr(choice, "installed_here", lambda: choice.Installed(
        cuda=True, flash_attn=False, te=False, varlen=None, flex=True, cudnn_frontend=True,
        cudnn_version=91900, sm=90))  # fmt: skip
    assert default_backend("first-run", cuda, torch.bfloat16)[0] == "cudnn"
    old = choice.Installed(cuda=True, flash_attn=False, te=False, varlen=None, flex=True,
                           cudnn_frontend=True, cudnn_version=91900, sm=80)  # fmt: skip
    monkeypatch.setattr(choice, "installed_here", lambda: old)
    backend, why = default_backend("first-run", cuda, torch.bfloat16)
    assert backend == "auto" and "needs sm90 or newer, this GPU is sm80" in why
