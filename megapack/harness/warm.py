"""What the worker pool's fork server imports once, so that every worker starts warm.

`megapack.harness.pool.WorkerPool` starts its workers from a ``forkserver``: the server imports
this module once (torch, megapack's names, megatron-core's ``PackedSeqParams``, quietly), and each
worker is a fork of it, with those modules already loaded. A worker so started, or restarted
after a fault, is ready in a fraction of a second instead of importing them again (~2 s each for
torch, ~5 s with megatron-core, on the 2-core dev machine). Nothing here starts a thread, so the
fork is safe. The import is the work: the module has no names to use.
"""

from __future__ import annotations

import contextlib
import importlib

from megapack.core.quiet import quiet_megatron

WARM = ("torch", "torch.distributed", "megapack", "megatron.core.packed_seq_params")
"""What the fork server imports (each worker still imports its pool's own ``preload`` list)."""

with quiet_megatron():  # megatron warns about missing apex/TE once per process
    for _name in WARM:
        with contextlib.suppress(Exception):  # an optional module may be missing
            _module = importlib.import_module(_name)
            for _attr in getattr(_module, "__all__", ()):  # a lazy package loads its names now
                getattr(_module, _attr, None)
