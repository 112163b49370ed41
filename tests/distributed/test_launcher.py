"""``placement launch``: loopback-only on one node, arguments checked before any rank starts, a rank's
failure in one line, and nothing left running after the launcher dies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import placement as pl
from placement.cli import main
from tests.distributed.test_torch_ranks import place

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

# a real "Root Cause" section as torchrun 2.x prints it for a rank killed by SIGKILL
TORCHRUN_KILLED = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
placement.launch FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : node
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                text = f.read()
        except OSError:
            continue
        parent = int(text[text.rindex(b")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


@pytest.mark.slow
def test_single_node_launch_listens_on_loopback_only(tmp_path):
    """One real 2-rank launch: every socket the launcher's processes listen on is loopback."""
    from placement.distributed.loopback import listening_addresses

    model, batch = place("mlp", 2)
    model.save(tmp_path / "placed.onnx")
    np.save(tmp_path / "x.npy", batch[0])
    command = [sys.executable, "-m", "placement.cli", "launch", str(tmp_path / "placed.onnx")]
    command += ["--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "out.npz"), "--timeout", "60"]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, cwd=tmp_path)
        seen: set[tuple[str, int]] = set()
        deadline = time.monotonic() + 240
        while proc.poll() is None:
            assert time.monotonic() < deadline, "launch did not finish"
            seen |= listening_addresses(_descendants(proc.pid))
            time.sleep(0.05)
    text = (tmp_path / "out.txt").read_text() + (tmp_path / "err.txt").read_text()
    assert proc.returncode == 0, text
    assert seen, "no listening socket was seen during the run"
    assert {address for address, _ in seen} <= LOOPBACK, seen
    rows = model.graph.inputs[0].shape[0]
    want = np.concatenate([pl.run(model, [batch[0][i : i + rows]])[0] for i in range(0, len(batch[0]), rows)])
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")[model.outputs[0]], want, rtol=1e-4, atol=1e-5)


def test_launch_checks_arguments_before_starting_ranks(tmp_path, capsys, monkeypatch):
    model, _ = place("mlp", 2)
    model.save(tmp_path / "placed.onnx")

    def no_torchrun(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(subprocess, "Popen", no_torchrun)
    monkeypatch.setattr(subprocess, "run", no_torchrun)
    placed = str(tmp_path / "placed.onnx")
    assert main(["launch", placed]) == 2  # no --input
    err = capsys.readouterr().err
    assert "no --input given" in err and len(err.strip().splitlines()) == 1
    np.save(tmp_path / "x.npy", np.zeros((2, 16), np.float32))
    x = str(tmp_path / "x.npy")
    for extra, message in [
        (["--threads", "-3"], "--threads must be a whole number"),
        (["--output", str(tmp_path / "missing" / "out.npz")], "does not exist"),
        (["--timeout", "0"], "--timeout must be positive"),
    ]:
        assert main(["launch", placed, "--input", x, *extra]) == 2
        assert message in capsys.readouterr().err


def test_a_rank_failure_is_one_line_with_details_behind_verbose(tmp_path, capsys, monkeypatch):
    from placement.distributed import launcher

    model, _ = place("mlp", 2)
    model.save(tmp_path / "placed.onnx")
    np.save(tmp_path / "x.npy", np.zeros((2, 16), np.float32))
    details = "Traceback (most recent call last):\n  ...\n" + TORCHRUN_KILLED

    def fake_run(command, *, single_node):
        return launcher.LaunchResult(1, launcher.failure_summary({}, details, 1), details)

    monkeypatch.setattr(launcher, "run_torchrun", fake_run)
    argv = ["launch", str(tmp_path / "placed.onnx"), "--input", str(tmp_path / "x.npy")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "rank 1 failed: killed by signal 9 (SIGKILL)" in err
    assert main(["-v", *argv]) == 2
    assert "ChildFailedError" in capsys.readouterr().err


def test_failure_summary_names_the_rank_that_failed_first():
    from placement.distributed.launcher import failure_summary

    errors = {0: "peer: run on rank 0 stopped: rank 1 failed", 1: "own: InputError: input 'x' has rank 1"}
    assert failure_summary(errors, TORCHRUN_KILLED, 1) == "rank 1 failed: InputError: input 'x' has rank 1"
    assert failure_summary({}, TORCHRUN_KILLED, 1) == "rank 1 failed: killed by signal 9 (SIGKILL)"
    stopped = {0: "peer: run on rank 0 stopped: rank 1 stopped without a report"}
    assert failure_summary(stopped, "", 1).startswith("rank 0: run on rank 0 stopped: rank 1")
    assert failure_summary({}, "boom\n", 1) == "torchrun failed (exit status 1): boom"


def test_single_node_command_binds_loopback_and_bounds_shutdown():
    from placement.distributed.launcher import SHUTDOWN_TIMEOUT, torchrun_command

    single = torchrun_command("m.onnx", nproc=2)
    assert "--rdzv-endpoint=127.0.0.1:0" in single and "--local-addr=127.0.0.1" in single
    assert "--loopback" in single and f"--shutdown-timeout={SHUTDOWN_TIMEOUT}" in single
    multi = torchrun_command("m.onnx", nproc=1, nnodes="2", rdzv_endpoint="host0:29400")
    assert "--loopback" not in multi and "--rdzv-endpoint=host0:29400" in multi
    with pytest.raises(pl.PlanError, match="--rdzv-endpoint"):
        torchrun_command("m.onnx", nproc=1, nnodes="2")


@pytest.mark.slow
def test_killing_the_launcher_ends_what_it_started(tmp_path):
    """kill -9 of the launcher: torchrun (here a stand-in) gets SIGTERM; a rank tied to its
    parent (as placement.launch ties itself to torchrun's agent) gets SIGKILL when that dies."""
    rank = textwrap.dedent(
        """
        import os, sys, time
        from placement.distributed.launcher import die_with_parent
        assert die_with_parent()
        print(os.getpid(), flush=True)
        time.sleep(120)
        """
    )
    agent = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {rank!r}])
        time.sleep(120)
        """
    )
    launcher_script = textwrap.dedent(
        f"""
        import sys
        from placement.distributed.launcher import run_torchrun
        run_torchrun([sys.executable, "-c", {agent!r}], single_node=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher_script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    tree: set[int] = {proc.pid}
    try:
        assert proc.stdout is not None
        rank_pid = int(proc.stdout.readline())
        tree = _descendants(proc.pid)
        assert rank_pid in tree and len(tree) == 3
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in tree - {proc.pid}):
            assert time.monotonic() < deadline, [p for p in tree if _alive(p)]
            time.sleep(0.05)
    finally:
        for pid in tree:
            if _alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(5)


def test_after_a_rank_failure_torchrun_stops_the_others_within_its_shutdown_timeout():
    """torchrun's rank-failure path waited a fixed 30 s for a rank ignoring SIGTERM (a stopped one)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from placement.distributed.torchrun import bounded_stop

    class Agent:
        _shutdown_timeout = 3

        def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
            self.timeout = timeout

    agent = Agent()
    with bounded_stop():
        LocalElasticAgent._stop_workers(agent, None)  # type: ignore[arg-type]
    assert agent.timeout == 3


class _Context:
    """A process context as torchrun's agent holds it: ``close(death_sig, timeout=30)``."""

    def close(self, death_sig=None, timeout=30):
        self.closed = (death_sig, timeout)


class _OldAgent:
    """torchrun's agent where ``_shutdown`` takes no timeout and closes its context after 30 s
    (torch 2.11 and older): the launcher's timeout must bound it all the same."""

    def __init__(self):
        self._pcontext = _Context()

    def _stop_workers(self, worker_group):
        self._shutdown()

    def _shutdown(self, death_sig=signal.SIGTERM):
        if self._pcontext:
            self._pcontext.close(death_sig)


def test_bounded_stop_bounds_an_agent_whose_shutdown_takes_no_timeout():
    from placement.distributed.torchrun import bounded_stop

    agent = _OldAgent()
    with bounded_stop(3, agent_class=_OldAgent):
        agent._stop_workers(None)
        assert agent._pcontext.closed == (signal.SIGTERM, 3)
        agent._shutdown(signal.SIGINT)  # the agent's own path on a signal
        assert agent._pcontext.closed == (signal.SIGINT, 3)
    assert "close" not in vars(agent._pcontext)
    agent._stop_workers(None)  # outside: the class is as it was
    assert agent._pcontext.closed == (signal.SIGTERM, 30)


def test_the_shutdown_flag_goes_to_torchrun_only_where_it_has_it(monkeypatch):
    """Detected from the installed torchrun's parser, not from torch's version."""
    from placement.distributed import torchrun

    assert {"--nproc-per-node", "--rdzv-endpoint"} <= torchrun.torchrun_flags()  # the real parser's
    seen = {}

    @contextlib.contextmanager
    def record(timeout=None, **_):
        seen["timeout"] = timeout
        yield

    monkeypatch.setattr(torchrun, "bounded_stop", record)
    monkeypatch.setattr("torch.distributed.run.main", lambda args: seen.setdefault("args", args))
    argv = ["--nproc-per-node=1", "--shutdown-timeout=3", "-m", "placement.launch", "m.onnx"]
    for flags, passed, timeout in [({"--shutdown-timeout"}, argv, None), (set(), argv[:1] + argv[2:], 3.0)]:
        seen.clear()
        monkeypatch.setattr(torchrun, "torchrun_flags", lambda flags=flags: frozenset(flags))
        assert torchrun.main(argv) == 0
        assert seen == {"timeout": timeout, "args": passed}
