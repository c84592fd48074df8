"""``python -m pdscope.cli``: the same command line as the ``pdscope`` console script."""

from __future__ import annotations

import sys

from pdscope.cli import main

sys.exit(main())
