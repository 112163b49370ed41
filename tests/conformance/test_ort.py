"""ONNX's node test suite in one plain ONNX Runtime session: the ceiling the placed runtime must reach.

Expected failures (ops this ORT build lacks, newer opsets, ...) are listed with
their reasons in ``xfail_ort.txt`` and run as strict xfail. Regenerate the list
(it only shrinks; ``--grow`` adds new failures for review)::

    .venv/bin/python -m tests.conformance._cases ort
"""

from __future__ import annotations

import pytest

from tests.conformance import _cases


@pytest.mark.parametrize("name", _cases.params("ort"))
def test_case(name: str) -> None:
    _cases.run_case(name, "ort")
