"""What every table of ``docs/benchmarks.md`` is made with: the results folder, reading a
results file, and the Markdown table and number formats (:mod:`benchmarks.tables`).

Example:
    >>> print(table(["model", "ms"], [["gpt", fmt(1.234)]]))
    | model | ms |
    |---|---|
    | gpt | 1.23 |
    >>> human_bytes(3 * 2**20)
    '3.0 MiB'
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PAGE", "RESULTS", "ROOT", "fmt", "human_bytes", "load_results", "table"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"


def load_results(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: Any, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
