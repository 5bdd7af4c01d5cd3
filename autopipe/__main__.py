"""``python -m autopipe``: see :mod:`autopipe.cli`."""

import sys

from autopipe.cli import main

sys.exit(main())
