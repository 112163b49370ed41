"""``python -m placement.cli``: the ``placement`` command.

Example:
    $ python -m placement.cli models
"""

from __future__ import annotations

import sys

from placement.cli import main

sys.exit(main())
