"""``python -m cats.cli``: the ``cats`` command."""

import sys

from cats.cli import main

sys.exit(main())
