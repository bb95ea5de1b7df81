"""``python -m autotune``: the same as the ``autotune`` command."""

import sys

from .cli import main

sys.exit(main())
