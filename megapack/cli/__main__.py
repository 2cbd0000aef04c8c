"""``python -m megapack.cli``: the ``megapack`` command line."""

import sys

from megapack.cli import main

sys.exit(main())
