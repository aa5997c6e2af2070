"""``python -m vla``: the ``vla`` command (``vla.cli``)."""

import sys

from vla.cli import main

sys.exit(main())
