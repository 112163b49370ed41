"""Tests for ``placement.graph.sizes``: reading and writing memory sizes."""

from __future__ import annotations

import pytest

import placement as pl
from placement.graph.sizes import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("spec", "expected"),
    [(1024, 1024), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5 GB", 1_500_000_000), ("3kib", 3072)],
)
def test_parse_bytes(spec, expected):
    assert parse_bytes(spec) == expected


@pytest.mark.parametrize("spec", ["", "GB", "-1GB", "2 parsecs", -5, True])
def test_parse_bytes_rejects(spec):
    with pytest.raises(pl.PlanError):
        parse_bytes(spec)


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 3 * 2**20, 5 * 2**30, None)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "3.0 MiB",
        "5.0 GiB",
        "-",
    ]
