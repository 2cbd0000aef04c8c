"""TEMPORARY re-export while the package moves (removed before landing)."""

from megapack.core.cp import *  # noqa: F403
from megapack.core.cp import CP_LAYOUTS, CpLayout, check_cp_spans, cp_indices, cp_pad_multiple  # noqa: F401
