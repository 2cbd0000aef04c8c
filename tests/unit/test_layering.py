"""House rule: megapack's production modules never import megapack.testing (helpers for tests only).

Every module under megapack/ except megapack/testing/ is parsed, and every ``import`` and
``from ... import`` statement in it, top-level or inside a function, is checked. A second test
imports the modules the CLI and the bench load and checks megapack.testing stayed out of
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


def test_production_modules_do_not_import_megapack_testing() -> None:
    files = sorted(
        p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts
    )
    assert PACKAGE / "cli.py" in files and PACKAGE / "bench" / "transfer.py" in files
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
        "megapack.bench.report, megapack.launch, megapack.grid, megapack.megatron_cpu; "
        "print(sorted(m for m in sys.modules if m.startswith('megapack.testing')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
