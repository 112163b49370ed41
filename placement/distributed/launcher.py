"""Start torchrun for ``placement launch``: loopback-only on one node, ranks tied to the launcher,
a rank's failure in one line.

* **What listens where.** torchrun's rendezvous store and the agent's store for the
  ranks (both ``TCPStore`` servers, unauthenticated) bind every interface by default;
  so do gloo's and NCCL's sockets on a host whose name resolves to an outside address.
  A single-node launch runs torchrun through :mod:`placement.distributed.torchrun`
  ``--loopback``, which binds both stores to ``127.0.0.1`` (``--local-addr 127.0.0.1``, the rendezvous
  at ``127.0.0.1:0``), and the ranks' transports to the loopback interface
  (``GLOO_SOCKET_IFNAME=lo``, ``NCCL_SOCKET_IFNAME=lo`` unless set). A multi-node launch
  binds what torchrun binds for the ``--rdzv-endpoint`` the user names: it must run on a
  private network (anyone who can reach the store can disrupt the run).
* **Lives.** torchrun gets SIGTERM when the launcher dies (even by ``kill -9``), and
  every rank gets SIGKILL when torchrun dies (``PR_SET_PDEATHSIG``), so nothing runs on
  after the launcher. torchrun waits :data:`SHUTDOWN_TIMEOUT` seconds for a rank it
  stops (not 30, also after a rank failure: :func:`placement.distributed.torchrun.bounded_stop`),
  so a stopped or hung rank ends the run soon after ``--timeout``.
* **Failures.** Each rank writes its one-line error to a folder the launcher names
  (``PLACEMENT_LAUNCH_ERRORS``); torchrun's own output is kept aside and shown with
  ``--verbose``. :func:`failure_summary` turns them into one line naming the rank.

Example:
    >>> cmd = torchrun_command("placed.onnx", nproc=2, script_args=["--input", "x.npy"])
    >>> cmd[1:4], "--local-addr=127.0.0.1" in cmd
    (['-m', 'placement.distributed.torchrun', '--loopback'], True)
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "torchrun_command",
    "launch_env",
    "run_torchrun",
    "failure_summary",
    "die_with_parent",
    "LaunchResult",
    "ERRORS_ENV",
    "TIE_ENV",
    "SHUTDOWN_TIMEOUT",
]

log = logging.getLogger(__name__)

#: Environment variable naming the folder where ranks write their one-line errors.
ERRORS_ENV = "PLACEMENT_LAUNCH_ERRORS"
#: Environment variable asking each rank to die with its parent (torchrun's agent).
TIE_ENV = "PLACEMENT_TIE_TO_PARENT"
#: Seconds torchrun waits for a rank it stops before killing it.
SHUTDOWN_TIMEOUT = 3
_PR_SET_PDEATHSIG = 1


def torchrun_command(
    model: str,
    *,
    nproc: int,
    script_args: Sequence[str] = (),
    nnodes: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "placement",
) -> list[str]:
    """The command line running ``python -m placement.launch MODEL`` under torchrun.

    Always through :mod:`placement.distributed.torchrun`. One node (``nnodes`` None or
    ``"1"``): ``--loopback``, every listening socket on ``127.0.0.1``. Several nodes:
    the c10d rendezvous at ``rdzv_endpoint`` (required), bound as torchrun binds it.

    Raises:
        PlanError: several nodes without ``rdzv_endpoint``.
    """
    from placement.errors import PlanError

    multi = bool(nnodes) and nnodes != "1"
    command = [sys.executable, "-m", "placement.distributed.torchrun"]
    command += [] if multi else ["--loopback"]
    command += [f"--nproc-per-node={nproc}"]
    if multi:
        if not rdzv_endpoint:
            raise PlanError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        command += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        command += [f"--rdzv-id={rdzv_id}"]
    else:
        command += ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
        command += [f"--rdzv-id={uuid.uuid4().hex}", "--local-addr=127.0.0.1"]
    command += [f"--shutdown-timeout={SHUTDOWN_TIMEOUT}"]
    command += ["-m", "placement.launch", str(model), *script_args]
    return command


def launch_env(
    *, single_node: bool, errors: str | os.PathLike[str] | None, base: Mapping[str, str]
) -> dict[str, str]:
    """The environment of torchrun and its ranks (a copy of ``base``)."""
    env = dict(base)
    env[TIE_ENV] = "1"
    if errors is not None:
        env[ERRORS_ENV] = str(errors)
    if single_node:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env["MASTER_ADDR"] = "127.0.0.1"
    return env


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where unsupported.

    If the parent is already gone (this process was re-parented before the call),
    the signal is sent now.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), sig)
    return True


def _tie_to_launcher() -> None:  # runs in torchrun's process between fork and exec
    die_with_parent(signal.SIGTERM)


@dataclass
class LaunchResult:
    """How a launch ended: torchrun's exit status, and on failure one line naming the rank."""

    returncode: int
    message: str | None
    details: str


def run_torchrun(command: Sequence[str], *, single_node: bool) -> LaunchResult:
    """Run ``command`` (from :func:`torchrun_command`) tied to this process.

    Its standard output passes through; its standard error (torchrun's log and
    tracebacks) is kept in :attr:`LaunchResult.details`. On failure
    :attr:`LaunchResult.message` is one line naming the rank and its error.
    """
    with (
        tempfile.TemporaryDirectory(prefix="placement-launch-") as folder,
        tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr,
    ):
        env = launch_env(single_node=single_node, errors=folder, base=os.environ)
        proc = subprocess.Popen(
            list(command),
            env=env,
            stderr=stderr,
            preexec_fn=_tie_to_launcher,  # noqa: PLW1509
        )
        try:
            code = proc.wait()
        except BaseException:  # Ctrl-C: torchrun got the same SIGINT; wait for it to stop the ranks
            with contextlib.suppress(BaseException):
                proc.wait(SHUTDOWN_TIMEOUT + 5)
            if proc.poll() is None:
                proc.kill()
            raise
        stderr.seek(0)
        details = stderr.read()
        errors = _rank_errors(Path(folder))
    if code == 0:
        return LaunchResult(0, None, details)
    return LaunchResult(code, failure_summary(errors, details, code), details)


def _rank_errors(folder: Path) -> dict[int, str]:
    found: dict[int, str] = {}
    for path in folder.glob("rank-*.txt"):
        with contextlib.suppress(ValueError, OSError):
            found[int(path.stem.split("-", 1)[1])] = path.read_text(errors="replace").strip()
    return found


_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)
_ROOT_SIGNAL = re.compile(r"Signal (\d+) \((\w+)\) received by PID")


def failure_summary(errors: Mapping[int, str], torchrun_stderr: str, returncode: int) -> str:
    """One line naming the rank that failed first and its error.

    ``errors``: rank -> the line it wrote (``"own: ..."`` for its own failure,
    ``"peer: ..."`` when it saw another rank fail); ``torchrun_stderr``: torchrun's
    output, whose "Root Cause" section names a rank killed by a signal.

    Example:
        >>> failure_summary({1: "own: InputError: bad x", 0: "peer: rank 1 failed"}, "", 1)
        'rank 1 failed: InputError: bad x'
        >>> failure_summary({}, "  rank      : 1 (local_rank: 1)\\n  exitcode  : -9 (pid: 7)\\n", 1)
        'rank 1 failed: killed by signal 9 (SIGKILL)'
    """
    own = {r: text.split(":", 1)[1].strip() for r, text in errors.items() if text.startswith("own:")}
    if own:
        rank = min(own)
        return f"rank {rank} failed: {own[rank]}"
    root = torchrun_stderr.rsplit("Root Cause", 1)[-1] if "Root Cause" in torchrun_stderr else torchrun_stderr
    ranks, exits = _ROOT_RANK.findall(root), _ROOT_EXIT.findall(root)
    if ranks and exits and int(exits[0]) < 0:
        number = -int(exits[0])
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown signal"
        return f"rank {ranks[0]} failed: killed by signal {number} ({name})"
    peer = {r: text.split(":", 1)[1].strip() for r, text in errors.items() if text.startswith("peer:")}
    if peer:
        rank = min(peer)
        return f"rank {rank}: {peer[rank]}"
    if ranks and exits:
        return f"rank {ranks[0]} failed with exit status {exits[0]} (run with --verbose for its output)"
    last = next((line.strip() for line in reversed(torchrun_stderr.splitlines()) if line.strip()), "")
    return f"torchrun failed (exit status {returncode}){': ' + last if last else ''}"


def record_rank_error(rank: int, message: str, *, own: bool) -> None:
    """Write this rank's one-line error where the launcher reads it (a no-op outside a launch)."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder:
        return
    line = " ".join(message.split())
    with contextlib.suppress(OSError):
        Path(folder, f"rank-{rank}.txt").write_text(f"{'own' if own else 'peer'}: {line}\n", encoding="utf-8")
