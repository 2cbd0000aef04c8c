"""``megapack bench`` (`megapack.bench.main`, the driver) and its sections, one module each:
`transfer`, `throughput` (over the modes of `modes`, summarized by `baselines`), `packing_quality`,
`dp_balance`, `cp_padding`, `pack_command`; `datasets` the length distributions, `report` the
outputs. The GPU kit is `megapack.bench.gpu`. Importing this package imports no section
(``megapack --help`` stays fast)."""

from megapack.bench.main import add_arguments, main, settings

__all__ = ["add_arguments", "main", "settings"]
