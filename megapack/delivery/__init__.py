"""Delivery: `get_batch_on_this_tp_rank` and `prefetch`, one direction from the TP source to its peers.

item -> normalize -> CP share -> encode (`wire`) -> transport send | transport receive -> decode,
orchestrated in `get_batch`; `prefetch` runs the same calls ahead in a thread. The local link
(`link`, `link_setup`) is private to `transport`. May import `megapack.core`,
`megapack.distributed` and `megapack.core.errors`; nothing here imports a module above it.
"""
