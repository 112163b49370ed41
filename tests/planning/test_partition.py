"""Tests for ``placement.planning.partition``: the exact partition problem."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from placement.planning.partition import partition_costs
from tests.planning.helpers import all_ends


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(st.integers(0, 50), min_size=1, max_size=10), parts=st.integers(1, 4))
def test_partition_costs_is_optimal_and_positive(costs, parts):
    sizes = partition_costs(costs, parts)
    assert sum(sizes) == len(costs) and len(sizes) == parts
    if len(costs) >= parts:
        assert all(s > 0 for s in sizes)
    bottleneck, start = 0, 0
    for s in sizes:
        bottleneck = max(bottleneck, sum(costs[start : start + s]))
        start += s
    brute = min(
        max(sum(costs[a:b]) for a, b in zip([0, *ends[:-1]], ends)) for ends in all_ends(len(costs), parts)
    )
    assert bottleneck == brute
