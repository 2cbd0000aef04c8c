"""Delivery: batches in one direction from the TP source to its peers.

    get_batch.py   `get_batch_on_this_tp_rank`, the front door: megapack's own form goes to
                   `deliver`, a caller's form to its adapter in callers.py
    deliver.py     `deliver`, the one orchestrator: item -> intake -> CP share -> encode (`wire`)
                   -> transport send | transport receive -> decode
    callers.py     the callers' conventions: Megatron-LM's, its older and Megatron-Bridge's calls
                   of `get_batch_on_this_tp_rank`, each an adapter onto `deliver`, and their whole
                   ``get_batch`` replacements (exported by `megapack.megatron`)
    wire.py        the frame: a header of int64 slots and the stage's fields
    transport.py   the transports (the local link is private to it: link.py, link_setup.py)
    prefetch.py    `prefetch`: the same calls ahead in a thread
    steps.py       `lockstep_steps`: every rank learns a whole step of data exists before a
                   pipeline schedule starts (agreement.py: what the ranks agree on at its first step;
                   step_report.py: the one line that says how the loop ended)
    graph.py       `GraphInputs`: the static buffers a captured training step reads

May import `megapack.core` and `megapack.distributed`; nothing here imports a module above it.
"""
