"""``placement models``: list the built-in models.

Example:
    $ placement models
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    """Add ``placement models`` and its options to ``sub`` (the command's subparsers)."""
    p = sub.add_parser(
        "models",
        help="list the built-in models",
        description="List the built-in models (usable as MODEL in every command, and in 'demo').",
        epilog="Example: placement models",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement models`` with the parsed ``args``, printing to ``console``; the exit status."""
    from rich.table import Table

    from placement import models

    table = Table(title="built-in models")
    table.add_column("name")
    table.add_column("description")
    for name, module in sorted(models.MODELS.items()):
        doc = (module.__doc__ or "").strip().splitlines()
        table.add_row(name + (" (default)" if name == models.DEFAULT_MODEL else ""), doc[0] if doc else "")
    console.print(table)
    return 0
