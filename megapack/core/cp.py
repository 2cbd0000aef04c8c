"""Deprecated: `megapack.core.cp` moved to `megapack.core.cp_share` (one name, one concept); this alias goes in a later release."""

import warnings

from megapack.core.cp_share import *  # noqa: F403

warnings.warn("megapack.core.cp moved to megapack.core.cp_share", DeprecationWarning, stacklevel=2)
