"""megapack.core.megatron_release: the installed megatron-core release, probed once, and the
parts of megatron-core megapack relies on, checked against whichever release is installed (CI runs
this file on megatron-core 0.16.1 and on 0.19.2)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from megapack.core import megatron_release as release_module
from megapack.core.megatron_release import SUPPORTED, megatron_release

ROOT = Path(__file__).resolve().parents[2]
MODULE = "megatron.core.packed_seq_params"


def megapack_sources() -> Iterator[tuple[Path, ast.AST]]:
    """Every module of megapack and of the examples, parsed."""
    for path in sorted([*(ROOT / "megapack").rglob("*.py"), *(ROOT / "examples").glob("*.py")]):
        yield path, ast.parse(path.read_text())


def test_the_first_probe_imports_megatron_quietly_and_later_calls_neither_import_nor_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import megatron.core

    from megapack.core import quiet

    entered: list[int] = []
    real = quiet.quiet_megatron

    @contextlib.contextmanager
    def counting() -> Iterator[None]:
        entered.append(1)
        with real():
            yield

    monkeypatch.setattr(quiet, "quiet_megatron", counting)
    monkeypatch.setattr(megatron.core, "packed_seq_params", sys.modules[MODULE])  # restored after
    monkeypatch.delitem(sys.modules, MODULE)  # as in a process that has not imported it yet
    megatron_release.cache_clear()
    try:
        release = megatron_release()
        fresh = sys.modules[MODULE]  # imported by the probe
        assert all(megatron_release() is release for _ in range(3))
    finally:
        megatron_release.cache_clear()  # the next call probes the restored module
    assert entered == [1]
    assert release.packed_seq_params is fresh.PackedSeqParams
    assert release.packed_seq_fields == {f.name for f in dataclasses.fields(fresh.PackedSeqParams)}


def test_the_installed_release_is_a_supported_one() -> None:
    release = megatron_release()
    assert release.supported and SUPPORTED[0] <= release.version <= SUPPORTED[1]
    assert release.version in SUPPORTED  # CI installs exactly the two ends (setup.py's test extra)


def test_version_text_is_read_as_major_minor_patch() -> None:
    parse = release_module.parse_version
    assert parse("0.19.2") == (0, 19, 2)
    assert parse("0.19.2+abc1234") == (0, 19, 2)  # package_info's git suffix
    assert parse("0.20.0rc1") == (0, 20, 0)
    with pytest.raises(ValueError, match=r"version 'main' does not start with major.minor.patch"):
        parse("main")


def test_the_installed_version_comes_from_the_distribution() -> None:
    from importlib.metadata import version

    from megatron.core import package_info

    got = release_module.installed_version()
    assert got == release_module.parse_version(version("megatron-core"))
    assert got == (package_info.MAJOR, package_info.MINOR, package_info.PATCH)


def test_a_source_checkout_without_metadata_reads_package_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata

    from megatron.core import package_info

    def absent(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    want = (package_info.MAJOR, package_info.MINOR, package_info.PATCH)
    assert release_module.installed_version() == want


@pytest.mark.parametrize(
    ("version", "warned"),
    [((0, 16, 1), False), ((0, 19, 2), False), ((0, 16, 0), True), ((0, 20, 0), True)],
)
def test_a_release_outside_the_tested_range_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, version: Any, warned: bool
) -> None:
    monkeypatch.setattr(release_module, "installed_version", lambda: version)
    megatron_release.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="megapack"):
            first, second = megatron_release(), megatron_release()
    finally:
        megatron_release.cache_clear()  # the next call probes the real release again
    assert first is second and first.version == version and first.supported is not warned
    lines = [r.getMessage() for r in caplog.records]
    if warned:
        want = f"megatron-core {'.'.join(map(str, version))} is outside the releases"
        assert len(lines) == 1 and lines[0].startswith(want), lines
        assert "(0.16.1 to 0.19.2)" in lines[0] and "'megatron-core>=0.16.1,<=0.19.2'" in lines[0]
    else:
        assert lines == []


# -- what megapack relies on, against the installed release ---------------------------------------
def parallel_state_calls() -> dict[str, str]:
    """``parallel_state`` function -> a place megapack or an example calls it (``ps.X(...)``)."""
    calls: dict[str, str] = {}
    for path, tree in megapack_sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("ps", "parallel_state")
            ):
                calls.setdefault(node.func.attr, f"{path.relative_to(ROOT)}:{node.lineno}")
    return calls


def test_megapack_calls_no_parallel_state_function_the_release_lacks_or_deprecates() -> None:
    from megatron.core import parallel_state

    calls = parallel_state_calls()
    assert {"initialize_model_parallel", "get_tensor_model_parallel_rank"} <= set(calls)
    for name, where in calls.items():
        function = getattr(parallel_state, name, None)
        assert callable(function), f"{where}: parallel_state.{name} is not in this megatron-core"
        assert "DeprecationWarning" not in inspect.getsource(function), (
            f"{where}: parallel_state.{name} is deprecated in this megatron-core"
        )


def test_the_deprecation_scan_sees_a_deprecated_function() -> None:
    """0.16.1 and 0.19.2 both deprecate setting the virtual pipeline rank globally: the scan
    above must see it (megapack passes vp_stage instead)."""
    from megatron.core import parallel_state

    source = inspect.getsource(parallel_state.set_virtual_pipeline_model_parallel_rank)
    assert "DeprecationWarning" in source
    assert "set_virtual_pipeline_model_parallel_rank" not in parallel_state_calls()


def test_megapack_sets_only_transformer_config_fields_the_release_has() -> None:
    from megatron.core.transformer import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    used: dict[str, str] = {}
    for path, tree in megapack_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TransformerConfig":
                for kw in node.keywords:
                    if kw.arg:
                        used.setdefault(kw.arg, f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {"num_layers", "hidden_size", "use_cpu_initialization"} <= set(used)
    missing = {name: where for name, where in used.items() if name not in fields}
    assert missing == {}, f"TransformerConfig fields this megatron-core lacks: {missing}"


def test_megapack_passes_the_schedules_only_arguments_every_schedule_takes() -> None:
    """Every call with ``forward_step_func=`` (a schedule's) in megapack and the examples uses
    keywords that the installed release's three schedules all accept."""
    from megatron.core.pipeline_parallel import schedules

    accepted = [
        set(inspect.signature(f).parameters)
        for f in (
            schedules.forward_backward_no_pipelining,
            schedules.forward_backward_pipelining_without_interleaving,
            schedules.forward_backward_pipelining_with_interleaving,
        )
    ]
    used: dict[str, str] = {}
    for path, tree in megapack_sources():
        for node in ast.walk(tree):
            names = {kw.arg for kw in getattr(node, "keywords", []) if kw.arg}
            if isinstance(node, ast.Call) and "forward_step_func" in names:
                for name in names:
                    used.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {"data_iterator", "num_microbatches", "seq_length", "micro_batch_size"} <= set(used)
    for name, where in used.items():
        assert all(name in a for a in accepted), f"{where}: a schedule does not take {name}="
