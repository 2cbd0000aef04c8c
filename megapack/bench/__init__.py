"""``megapack bench`` (`megapack.bench.main`) and its sections, one module each; the GPU kit in
`megapack.bench.gpu`. Importing this package imports no section (``megapack --help`` stays fast)."""

from megapack.bench.main import add_arguments, main, settings

__all__ = ["add_arguments", "main", "settings"]
