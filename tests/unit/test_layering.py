"""House rules on imports: lower layers never import higher ones, production never imports testing.

The packages, lowest first (each may import those to its left that its row names):

    core           the batch contract: fields, PackedBatch, Megatron dicts, CP shares, PackedSeqParams
    distributed    topology, groups, timed collectives, lockstep            (core)
    delivery       get_batch_on_this_tp_rank, transports, prefetch          (core, distributed)
    attention      PackedAttention and its kernels                          (core)
    megatron       the layer spec and losses                                (core, attention;
                   delivery: its namespace gives trainers the whole replacements of Megatron-LM's
                   and Megatron-Bridge's get_batch, which live with the other callers'
                   conventions in megapack.delivery.callers, one module for all of them; the
                   delivery imports nothing of megatron, so no cycle)
    packing, data  planning rows; readers and writers                       (core; data: + distributed, packing)
    harness        worker pool, megatron on CPU, the tiny GPT               (all of the above)
    bench, cli     `megapack bench`, the command line                       (all of the above; cli: + bench)
    testing        helpers for tests                                        (anything)

Every module under megapack/ is parsed, and every ``import`` and ``from ... import`` statement in
it, top-level or inside a function, is checked against its package's row (`ALLOWED`). A further
test imports the modules the CLI and the bench load and checks megapack.testing stayed out of
``sys.modules``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import megapack

PACKAGE = Path(megapack.__file__).parent


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of the modules ``source`` (a module of ``package``) imports, anywhere in it.

    ``from a.b import c`` yields both ``a.b`` and ``a.b.c`` (c may be a submodule); relative
    imports are resolved against ``package``.
    """
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def _testing(names: set[str]) -> set[str]:
    return {n for n in names if n == "megapack.testing" or n.startswith("megapack.testing.")}


def test_imported_modules_sees_every_form() -> None:
    source = (
        "import os\n"
        "from megapack.testing.pool import WorkerPool\n"
        "def f():\n"
        "    from ..testing import grids\n"
        "    import megapack.testing.gpt as g\n"
        "    from . import report\n"
    )
    names = imported_modules(source, "megapack.bench")
    assert _testing(names) == {
        "megapack.testing",
        "megapack.testing.grids",
        "megapack.testing.gpt",
        "megapack.testing.pool",
        "megapack.testing.pool.WorkerPool",
    }
    assert {"os", "megapack.bench", "megapack.bench.report"} <= names


BELOW_HARNESS = {"core", "distributed", "delivery", "attention", "megatron", "packing", "data"}
ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "distributed": {"core", "distributed"},
    "delivery": {"core", "distributed", "delivery"},
    "attention": {"core", "attention"},
    "megatron": {"core", "attention", "megatron", "delivery"},
    "packing": {"core", "packing"},
    "data": {"core", "distributed", "packing", "data"},
    "harness": BELOW_HARNESS | {"harness"},
    "bench": BELOW_HARNESS | {"harness", "bench"},
    "cli": BELOW_HARNESS | {"harness", "bench", "cli"},
}
"""Package -> the megapack packages its modules may import (megapack.testing: anything)."""


def layer_of(module: str) -> str | None:
    """``megapack.core.fields`` -> ``core``; the package itself and its top-level modules: None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else None


def layer_violations(path: Path) -> list[str]:
    """The megapack modules ``path`` imports that its package's row does not allow."""
    rel = path.relative_to(PACKAGE.parent)
    package = ".".join(rel.with_suffix("").parts[:-1])
    own = layer_of(".".join(rel.with_suffix("").parts))
    if own is None or own == "testing":
        return []
    bad = set()
    for name in imported_modules(path.read_text(), package):
        if name.startswith("megapack."):
            target = layer_of(name)
            if target is not None and target not in ALLOWED[own] and target != "testing":
                bad.add(name)
            if target is None and name.count(".") == 1:
                public = name.split(".")[1] in megapack._EXPORTS  # `from megapack import X`
                if not public or own not in ("harness", "bench", "cli"):
                    bad.add(name)  # the public API is for the top layers; other modules: a layer
    return sorted(bad)


def test_every_package_is_in_a_layer_and_imports_only_below_it() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages - {"testing"} == set(ALLOWED), packages
    offenders = {
        p.relative_to(PACKAGE.parent).as_posix(): bad
        for p in sorted(PACKAGE.rglob("*.py"))
        if (bad := layer_violations(p))
    }
    assert offenders == {}


def test_the_layer_check_catches_a_climb(tmp_path: Path) -> None:
    # core importing the delivery (lazily, inside a function) is a climb; delivery importing core is not.
    climb = PACKAGE / "core" / "_climb_probe.py"
    ok = PACKAGE / "delivery" / "_ok_probe.py"
    try:
        climb.write_text("def f():\n    from megapack.delivery import wire\n")
        ok.write_text("from megapack.core import fields\n")
        assert layer_violations(climb) == ["megapack.delivery", "megapack.delivery.wire"]
        assert layer_violations(ok) == []
    finally:
        climb.unlink()
        ok.unlink()


def test_production_modules_do_not_import_megapack_testing() -> None:
    files = sorted(
        p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts
    )
    assert PACKAGE / "cli" / "__init__.py" in files and PACKAGE / "bench" / "transfer.py" in files
    offenders = {}
    for path in files:
        rel = path.relative_to(PACKAGE.parent)
        package = ".".join(rel.with_suffix("").parts[:-1])
        bad = _testing(imported_modules(path.read_text(), package))
        if bad:
            offenders[rel.as_posix()] = sorted(bad)
    assert offenders == {}


def test_cli_and_bench_imports_leave_megapack_testing_out() -> None:
    code = (
        "import sys, megapack, megapack.cli, megapack.bench, megapack.bench.transfer, "
        "megapack.bench.report, megapack.harness.pool, megapack.harness.grid, megapack.harness.megatron_cpu; "
        "print(sorted(m for m in sys.modules if m.startswith('megapack.testing')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
