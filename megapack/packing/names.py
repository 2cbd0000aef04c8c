"""The names every module and CLI choice list reads: packing algorithms, long-document policies,
balance modes.

Defined here once (a leaf module, nothing imported) so that `plan`, `StreamingPacker`,
`PackedDataset`, `PackWriter`, the CLI's ``choices=`` and the bench cannot drift apart.
"""

ALGORITHMS = ("bfd", "ffd", "first_fit", "next_fit", "best")
"""`megapack.packing.plan` algorithms, in the order the CLI lists them ("bfd" is the default)."""

LONG_DOC_POLICIES = ("split", "truncate", "drop", "error")
"""What happens to a document longer than a row (see `megapack.packing.pieces`); "split" is the
default."""

BALANCE_MODES = ("token", "compute")
"""How rows are dealt to data-parallel ranks (see `megapack.packing.balance`): "token" keeps the
seeded shuffle, "compute" balances every global batch's step cost; "token" is the default."""
