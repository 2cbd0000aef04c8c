"""Packaging claims match the code: the Python versions, the bundled data, the entry points."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def setup_kwargs() -> dict[str, object]:
    call = next(
        node
        for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup"
    )
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg in {
        "python_requires", "package_data", "entry_points", "install_requires",
        "extras_require"}}  # fmt: skip


def test_lowest_python_is_claimed_everywhere_and_is_what_runs_here() -> None:
    kwargs = setup_kwargs()
    assert kwargs["python_requires"] == ">=3.11"
    tools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert tools["ruff"]["target-version"] == "py311"
    assert tools["mypy"]["python_version"] == "3.11"
    uses_311 = [p for p in (ROOT / "megapack").rglob("*.py") if ".add_note(" in p.read_text()]
    assert uses_311, "nothing needs 3.11 any more: lower python_requires and CI's Python together"
    assert sys.version_info >= (3, 11)


def test_bundled_data_ships_with_the_package() -> None:
    patterns = setup_kwargs()["package_data"]["megapack.bench"]  # type: ignore[index]
    data = ROOT / "megapack" / "bench" / "data"
    shipped = {p.name for pattern in patterns for p in data.glob(pattern.removeprefix("data/"))}
    assert {"openchat_v1_lengths.json", "README.md"} <= shipped


def test_console_script_and_dash_m_share_main() -> None:
    scripts = setup_kwargs()["entry_points"]["console_scripts"]  # type: ignore[index]
    assert scripts == ["megapack=megapack.cli:main"]
    assert re.search(r"from megapack\.cli import main", (ROOT / "megapack/__main__.py").read_text())


def test_megatron_core_range_is_the_tested_one_and_each_python_gets_its_line() -> None:
    """setup.py declares megatron_release.SUPPORTED (lowest tested, highest run); the test extra
    pins the lowest for Python 3.11 and the highest for 3.12 (0.17 onwards need 3.12), and this
    environment runs the release its Python is pinned to (CI runs the suite on both)."""
    from importlib.metadata import version

    from megapack.core.megatron_release import SUPPORTED, installed_version

    low, high = (".".join(map(str, v)) for v in SUPPORTED)
    kwargs = setup_kwargs()
    mcore = [r for r in kwargs["install_requires"] if r.startswith("megatron-core")]  # type: ignore[attr-defined]
    assert mcore == [f"megatron-core>={low},<={high}"]
    pins = [r for r in kwargs["extras_require"]["test"] if r.startswith("megatron-core")]  # type: ignore[index]
    assert pins == [
        f'megatron-core=={low}; python_version < "3.12"',
        f'megatron-core=={high}; python_version >= "3.12"',
    ]
    want = SUPPORTED[0] if sys.version_info < (3, 12) else SUPPORTED[1]
    assert installed_version() == want, (
        f"Python {sys.version_info[:2]} runs megatron-core {version('megatron-core')}; the test "
        "extra pins " + ".".join(map(str, want)) + ": pip install -e '.[test]'"
    )
