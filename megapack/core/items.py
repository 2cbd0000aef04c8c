"""Deprecated: `megapack.core.items` moved to `megapack.core.normalize` (one name, one concept); this alias goes in a later release."""

import warnings

from megapack.core.normalize import *  # noqa: F403

warnings.warn(
    "megapack.core.items moved to megapack.core.normalize", DeprecationWarning, stacklevel=2
)
