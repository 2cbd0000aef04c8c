"""``python -m megapack``: the ``megapack`` command line (`megapack.cli`)."""

import sys

from megapack.cli import main

sys.exit(main())
