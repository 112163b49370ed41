"""Tests for ``placement.runtime.schedule.dag``: stages that form a DAG on a worker each."""

from __future__ import annotations

import threading

import pytest

from placement.errors import PipelineError
from placement.runtime.schedule.dag import DagWorkers, dependents_of, graph_width, topological_check
from tests.runtime.helpers import no_thread_leak  # noqa: F401 (an autouse fixture)

DIAMOND = [(), (), (0, 1), (0, 1), (2, 3)]  # a split layer: two branches, two more, a join


def test_graph_width_tells_a_chain_from_a_dag():
    assert graph_width([(), (0,), (1,)]) == 1
    assert graph_width(DIAMOND) == 2
    assert graph_width([(), (), (), (0, 1, 2)]) == 3
    assert graph_width(DIAMOND, [True, False, True, True, True]) == 2
    assert dependents_of(DIAMOND) == [[2, 3], [2, 3], [4], [4], []]
    with pytest.raises(ValueError, match="topological"):
        topological_check([(1,), ()])


def test_each_stage_runs_after_what_it_reads_and_in_micro_batch_order():
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def stage(j: int):
        def fn(i: int, env: dict) -> None:
            for d in DIAMOND[j]:
                assert (i, d) in env["done"], (i, j, d)
            with lock:
                seen.append((i, j))
                env["done"].add((i, j))

        return fn

    with DagWorkers([stage(j) for j in range(5)], DIAMOND) as workers:
        results = workers.map([{"done": set()} for _ in range(4)])
    assert [len(r["done"]) for r in results] == [5] * 4
    for j in range(5):  # every stage took the micro-batches in order
        assert [i for i, s in seen if s == j] == [0, 1, 2, 3]
    assert len(workers.timeline) == 20


def test_independent_stages_run_at_once():
    """Stages 0 and 1 wait for each other at a barrier: a chain would break it."""
    barrier = threading.Barrier(2, timeout=10)
    stages = [lambda i, env: barrier.wait(), lambda i, env: barrier.wait(), lambda i, env: None]
    with DagWorkers(stages, [(), (), (0, 1)]) as workers:
        workers.map([{}, {}])
    runs = {(r.stage, r.microbatch): r for r in workers.timeline}
    for i in range(2):
        a, b = runs[0, i], runs[1, i]
        assert a.start < b.end and b.start < a.end and a.thread != b.thread


def test_a_failure_names_its_stage_and_micro_batch_and_stops_the_run():
    def boom(i: int, env: dict) -> None:
        if i == 1:
            raise ValueError("bad micro-batch")

    with DagWorkers([lambda i, env: None, boom, lambda i, env: None], [(), (), (0, 1)], ["a", "b", "c"]) as w:
        with pytest.raises(PipelineError, match=r"stage 1 \(b\) failed on micro-batch 1") as caught:
            w.map([{}, {}, {}])
    assert isinstance(caught.value.__cause__, ValueError)
