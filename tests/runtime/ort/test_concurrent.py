"""Independent stages run at once: the split model's stage DAG, concurrent runs equal sequential ones."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest

import placement as pl
from placement.models import gpt, mlp
from placement.runtime.ort.concurrent import ConcurrentRun, stage_width
from placement.runtime.stages import split_stages


@functools.cache
def _split(name: str) -> tuple[pl.Model, list[np.ndarray]]:
    module, args = {"mlp": mlp, "gpt": gpt}[name].build("tiny")
    model = pl.from_torch(module, args)
    pl.split_tensor_parallel(model, devices=[0, 1])
    return model, [a.numpy() for a in args]


def test_stage_width() -> None:
    assert stage_width([(), (0,), (1,)]) == 1
    assert stage_width([(), (), (0, 1)]) == 2


def test_collectives_cut_stages_so_branches_do_not_wait() -> None:
    model, _ = _split("mlp")
    stages = split_stages(model).stages
    # per device: its branch up to the partial sum; then the all-reduce and the rest
    assert [(str(s.device), s.depends_on) for s in stages][:2] == [("cuda:0", ()), ("cuda:1", ())]
    assert stage_width([s.depends_on for s in stages]) == 2


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_concurrent_run_equals_the_sequential_run_bitwise(name: str) -> None:
    model, feeds = _split(name)
    device_map = {0: "cpu", 1: "cpu"}
    concurrent = pl.Runner(model, device_map=device_map, fold=False)
    sequential = pl.Runner(model, device_map=device_map, fold=False, concurrent=False)
    assert isinstance(concurrent.program.concurrent, ConcurrentRun)
    assert sequential.program.concurrent is None
    for _ in range(3):
        np.testing.assert_array_equal(concurrent.run(feeds)[0], sequential.run(feeds)[0])


def test_branches_run_on_two_threads_at_once() -> None:
    model, feeds = _split("mlp")
    runner = pl.Runner(model, device_map={0: "cpu", 1: "cpu"}, fold=False)
    run = runner.program.concurrent
    seen: set[int] = set()
    for step in run.steps:
        original = step.run

        def spy(values, binding=None, _original=original):
            seen.add(threading.get_ident())
            return _original(values, binding)

        object.__setattr__(step, "run", spy)
    run.run(feeds)
    assert len(seen) == 2


def test_a_failing_stage_raises_on_the_callers_thread() -> None:
    model, feeds = _split("mlp")
    runner = pl.Runner(model, device_map={0: "cpu", 1: "cpu"}, fold=False)
    with pytest.raises(pl.PlacementError):
        runner.run([feeds[0][:, :3]])  # wrong width: a stage fails
    np.testing.assert_array_equal(runner.run(feeds)[0], runner.run(feeds)[0])  # still usable
