"""Choose the transport `get_batch_on_this_tp_rank` takes on CPU, for tests of each path."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from megapack.local_link import LINK_ENV


@contextmanager
def local_links(enabled: bool) -> Iterator[None]:
    """Within the block, TP groups on one host use local links (True) or gloo collectives (False).

    Sets $MEGAPACK_LOCAL_LINK in this process; every rank of a group must enter it alike.
    """
    before = os.environ.get(LINK_ENV)
    os.environ[LINK_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LINK_ENV, None)
        else:
            os.environ[LINK_ENV] = before
