"""Races of stages running at once in the torch runtime: the branches of one
micro-batch share its environment dict, so what a stage reads of it must not trip over what
a sibling branch writes meanwhile."""

from __future__ import annotations

import contextlib
import sys
import threading

import torch

from placement.errors import PipelineError
from placement.runtime.schedule.dag import DagWorkers
from placement.runtime.torch.stage_exec import signal, wait_for_stage
from tests.runtime.helpers import no_thread_leak  # noqa: F401 (an autouse fixture)

CPU = torch.device("cpu")


def test_host_stage_reads_env_while_a_sibling_branch_writes_it() -> None:
    """Each branch does what ``_forward_only``'s stage function does (wait for its inputs,
    write its outputs into the shared env, signal): a host stage's look for stream devices
    walked the env while a sibling inserted keys (``dictionary changed size during
    iteration``)."""
    value = torch.zeros(1)

    def branch(j: int):
        def fn(i: int, env: dict) -> None:
            wait_for_stage(env, CPU)
            for k in range(200):
                env[f"b{j}_{k}"] = value
            signal(env, CPU)

        return fn

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the race shows within a few rounds
    try:
        with DagWorkers([branch(0), branch(1), branch(2)], [(), (), ()]) as workers:
            for _ in range(100):
                envs = workers.map([{f"x{k}": value for k in range(50)} for _ in range(4)])
                assert all(len(env) == 650 for env in envs)
    finally:
        sys.setswitchinterval(interval)


def test_a_worker_whose_context_fails_raises_in_the_caller() -> None:
    """A worker that cannot enter its context (its grad mode, thread budget, device) ran no
    stage: the caller used to wait for its micro-batches for ever. The check runs the map on
    a thread of its own, so a hang fails the test instead of the suite."""

    @contextlib.contextmanager
    def context(j: int):
        if j == 1:
            raise RuntimeError("no budget for you")
        yield

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            with DagWorkers([lambda i, env: None] * 3, [(), (), (0, 1)], context=context) as workers:
                workers.map([{}, {}])
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - inspected below
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the caller waits for a worker that died"
    assert isinstance(outcome[0], PipelineError) and "no budget for you" in str(outcome[0])
