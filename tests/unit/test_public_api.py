"""The public API (docs/architecture.md, "Public API") and the code agree: each namespace's
``__all__`` is exactly the table's row, every name imports, and no name is public twice."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
EMPTY = ("megapack.core", "megapack.distributed", "megapack.delivery", "megapack.harness",
         "megapack.testing")  # fmt: skip


def documented() -> dict[str, list[str]]:
    """The "Public API" table: namespace -> names, in the order written."""
    text = DOC.read_text(encoding="utf-8").split("## Public API", 1)[1]
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"\| `(megapack[\w.]*)` \| (.+) \|$", line)
        if match:
            before_note = match.group(2).split(" (")[0]
            rows[match.group(1)] = re.findall(r"`(\w+)`", before_note)
    return rows


def test_the_table_lists_every_public_namespace() -> None:
    rows = documented()
    assert set(rows) == {"megapack", "megapack.data", "megapack.packing", "megapack.megatron",
                         "megapack.attention", "megapack.cli", "megapack.bench"}  # fmt: skip
    assert len(rows["megapack"]) == 20  # the front door stays small


@pytest.mark.parametrize("namespace", sorted(documented()))
def test_each_namespace_exports_exactly_its_row(namespace: str) -> None:
    module = importlib.import_module(namespace)
    names = documented()[namespace]
    assert sorted(module.__all__) == sorted(names), namespace
    for name in names:
        assert getattr(module, name) is not None, f"{namespace}.{name}"


def test_nothing_is_public_twice_and_the_rest_export_nothing() -> None:
    """One thing, one public name: no object is exported by two namespaces (or two names)."""
    seen: dict[int, str] = {}
    for namespace, names in documented().items():
        module = importlib.import_module(namespace)
        for name in names:
            value = getattr(module, name)
            if isinstance(value, (str, tuple, frozenset)):
                continue  # constants compare by value, not identity
            where = f"{namespace}.{name}"
            assert id(value) not in seen, f"{where} is also public as {seen.get(id(value))}"
            seen[id(value)] = where
    for namespace in EMPTY:
        assert not getattr(importlib.import_module(namespace), "__all__", []), namespace
