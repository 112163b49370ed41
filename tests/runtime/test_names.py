"""Tests for ``placement.runtime.names``: unknown names reported before missing ones, each listed."""

from __future__ import annotations

import pytest

import placement as pl
from placement.runtime.names import check_names

MESSAGES = {"unknown": "unknown {names} of {expected}", "missing": "missing {names} of {expected}"}


def test_exact_names_pass_in_any_order():
    check_names(["b", "a"], ["a", "b"], error=pl.InputError, **MESSAGES)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["a", "z", "y"], "unknown 'z', 'y' of 'a', 'b'"),  # unknown first, in the order given
        (["b"], "missing 'a' of 'a', 'b'"),
        ([], "missing 'a', 'b' of 'a', 'b'"),
    ],
)
def test_offenders_are_named(given, message):
    with pytest.raises(pl.InputError) as info:
        check_names(given, ["a", "b"], error=pl.InputError, **MESSAGES)
    assert str(info.value) == message


def test_show_writes_the_names():
    with pytest.raises(pl.DeviceError, match=r"^unknown cuda:2 of cuda:0$"):
        check_names(
            [pl.Device("cuda", 2)], [pl.Device("cuda", 0)], error=pl.DeviceError, show=str, **MESSAGES
        )
