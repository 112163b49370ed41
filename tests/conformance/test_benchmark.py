"""``benchmarks/conformance.py`` prints the table and writes its results (ORT column only: fast)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_conformance_benchmark_table(tmp_path, capsys):
    from benchmarks import conformance

    out = tmp_path / "conformance.json"
    assert conformance.main(["--runtimes", "ort", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| ORT (one session)" in printed and "vs ORT" in printed
    (row,) = json.loads(out.read_text())["results"]
    assert row["runtime"] == "ort" and row["cases"] == row["passed"] + len(row["failed_cases"])
    from tests.conformance import _cases

    assert set(row["failed_cases"]) == set(_cases.expected_failures_here("ort"))
