"""Faithful re-creations of the callers megapack's forms serve, as test code.

Written from their public source (read, not copied): Megatron-LM's ``pretrain_gpt.py`` at main
(`pretrain_gpt`) and before its PR #4103 (`pretrain_gpt_pre_4103`), Megatron-Bridge's
``training/gpt_step.py`` and ``training/utils/batch_utils.py`` (`bridge`). Each keeps the
caller's own logic and the names it imports; megatron-core's come through `megatron_core`
(the installed release's where it has them, a re-creation of 0.19.2's where it does not), and
Megatron-LM's ``get_args`` through `megatron_training`.

`load` builds a fresh copy of a re-creation, optionally with lines executed after it (the
migration guide's one-line change: a later import shadows the caller's name, as it does when
added after the file's imports or after its ``def get_batch``); `guide_lines` reads those lines
from docs/megatron.md, so the grid tests run exactly what the guide says.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
GUIDE = HERE.parents[2] / "docs" / "megatron.md"


def load(name: str, lines: str = "") -> SimpleNamespace:
    """A fresh copy of re-creation ``name`` (a module of this package), with ``lines`` run after
    it in its namespace (its functions see the names they rebind)."""
    path = HERE / f"{name}.py"
    ns: dict[str, object] = {"__name__": f"{__name__}.{name}_copy", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    if lines:
        exec(compile(lines, f"{GUIDE.name} lines", "exec"), ns)
    return SimpleNamespace(**ns)


def guide_lines(marker: str) -> str:
    """The Python block of docs/megatron.md whose text contains ``marker``."""
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.M | re.S)
    found = [textwrap.dedent(b) for b in blocks if marker in b]
    if len(found) != 1:
        raise LookupError(f"{GUIDE.name} has {len(found)} Python blocks with {marker!r}, not 1")
    return found[0]
