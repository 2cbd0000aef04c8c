"""Deprecated: `megapack.attention.cp` moved to `megapack.attention.cp_attention` (one name, one concept); this alias goes in a later release."""

import warnings

from megapack.attention.cp_attention import *  # noqa: F403

warnings.warn(
    "megapack.attention.cp moved to megapack.attention.cp_attention",
    DeprecationWarning,
    stacklevel=2,
)
