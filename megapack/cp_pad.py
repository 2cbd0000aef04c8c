"""TEMPORARY re-export while the package moves (removed before landing)."""

from megapack.core.cp_pad import cp_pad_multiple  # noqa: F401
