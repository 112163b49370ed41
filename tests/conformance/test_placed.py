"""ONNX's node test suite through ``pl.run``, the model placed on two emulated logical devices.

Two placements: ``last`` (the last op moved to device 1, so graph outputs and
their copies cross a device) and ``alternate`` (every other op moved, so copies
sit on many edges). The bar: every case plain ONNX Runtime passes
(``test_ort.py``) passes placed too, with sequences, optionals and string tensors
going in and out as ONNX Runtime takes and returns them. Expected failures are
in ``xfail_placed_last.txt`` / ``xfail_placed_alternate.txt`` (strict xfail);
regenerate them (they only shrink; ``--grow`` adds new failures for review)::

    .venv/bin/python -m tests.conformance._cases placed_last placed_alternate
"""

from __future__ import annotations

import pytest

from tests.conformance import _cases


@pytest.mark.parametrize("name", _cases.params("placed_last"))
def test_last_op_moved(name: str) -> None:
    _cases.check(_cases.cases()[name], "placed_last")


@pytest.mark.parametrize("name", _cases.params("placed_alternate"))
def test_every_other_op_moved(name: str) -> None:
    _cases.check(_cases.cases()[name], "placed_alternate")


@pytest.mark.parametrize("placement", ["placed_last", "placed_alternate"])
def test_placed_fails_only_where_plain_ort_fails(placement: str) -> None:
    beyond = sorted(set(_cases.expected_failures(placement)) - set(_cases.expected_failures("ort")))
    assert not beyond, f"{placement} fails {len(beyond)} cases plain ONNX Runtime passes: {beyond[:20]}"
