"""``docs/tensor-parallel.md`` shows what ``benchmarks/tp_predict.py`` computes with ``pl.predict``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.tp_predict import render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tensor-parallel.md"


def _shown() -> str:
    found = re.search(r"<!-- tp-predict-table -->\n(.*?)\n<!-- /tp-predict-table -->", PAGE.read_text(), re.S)
    assert found is not None, "docs/tensor-parallel.md lost its predicted table"
    return found.group(1)


@pytest.mark.slow
def test_the_predicted_table_is_computed():
    assert _shown() == render(), "out of date: paste the output of python benchmarks/tp_predict.py"


def test_the_table_says_when_a_split_pays():
    """Few tokens per step: latency-bound, auto keeps one device; 2048 tokens on 2 GPUs: a split pays."""
    rows = [line.strip("|").split("|") for line in _shown().splitlines()[2:]]
    table = {(int(r[0]), int(r[1])): [c.strip() for c in r[2:]] for r in rows}
    assert {k[0] for k in table} == {2, 128, 2048} and {k[1] for k in table} == {2, 4, 8}
    for gpus in (2, 4, 8):
        assert table[(2, gpus)][4] == "1 x 1" and float(table[(2, gpus)][3]) < 1
    assert float(table[(2048, 2)][3]) > 1 and table[(2048, 2)][4] == "1 x 2"
