"""`cp_pad_multiple`: the multiple each document is padded to under context parallelism, torch-free.

Transformer Engine's THD context parallelism cuts every document into ``2 * cp`` equal chunks
(`megapack.core.cp_share`, "document" layout), so each document's span must be a multiple of ``2 * cp``, and of
any ``pad_to_multiple_of`` the caller asks for: their lcm. Its own module so that planning and
``megapack pack`` (`megapack.data.packed_dir`) read it without importing torch, which `megapack.core.cp_share`
needs for everything else; `megapack.core.cp_share` re-exports it.

Worked example: cp 4 -> 8; cp 2 with pad_to_multiple_of 8 -> lcm(8, 4) = 8; cp 1 -> pad_to_multiple_of.
"""

from __future__ import annotations

import math

from megapack.core.checks import check_int


def cp_pad_multiple(cp_size: int, pad_to_multiple_of: int = 1) -> int:
    """The multiple every document is padded to for the "document" layout: lcm(pad_to_multiple_of, 2*cp).

    Raises:
        TypeError: ``cp_size`` or ``pad_to_multiple_of`` is not an int, naming it and its value.
        ValueError: ``cp_size`` or ``pad_to_multiple_of`` is below 1, naming it and its value.

    Example:
        >>> cp_pad_multiple(4), cp_pad_multiple(2, 8), cp_pad_multiple(1, 3)
        (8, 8, 3)
    """
    cp_size = check_int("cp_size", cp_size, minimum=1)
    pad_to_multiple_of = check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1)
    return pad_to_multiple_of if cp_size == 1 else math.lcm(pad_to_multiple_of, 2 * cp_size)
