"""SIGTERM during a save: the save unwinds, its temporaries go, then the process ends by SIGTERM.

A save (:func:`placement.graph.saving.save`, :func:`placement.graph.atomic.write_atomic`)
runs inside :func:`guarded`. In the main thread, while the program keeps SIGTERM's
default action, the guard installs a handler that turns SIGTERM into an exception
(:class:`Terminated`) that unwinds the save as ``KeyboardInterrupt`` would: ``finally``
blocks remove what it wrote. When the outermost guard has unwound, the process ends by
SIGTERM, as it would have without the save.

Correct by construction, whenever the signal lands:

* the handler is installed *before* anything is created, and restored only *after*
  everything is removed (a SIGTERM before or after the guard finds nothing to leave);
* the steps that must not be cut in half (creating and registering a temporary
  folder, the renames that switch a save into place, the clean-up, the handler's
  restore) run :func:`deferred`: a SIGTERM there is held and raised when they end;
* every temporary folder in flight, in any thread, is registered before it exists
  (:func:`make_temporary`); when a SIGTERM ends the process, the folders of saves
  still running in other threads are removed first.

Signal handlers belong to the main thread: a save running in another thread while the
main thread is not itself saving cannot catch SIGTERM; its folder is left to the next
save into that folder (:func:`placement.graph.atomic.clean_stale_temporaries`).
A program that set its own SIGTERM handler (or ignores SIGTERM) keeps it.

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with guarded():
    ...     tmp = make_temporary(folder, ".placement-save-example-")
    ...     try:
    ...         pass  # write under tmp, rename into place
    ...     finally:
    ...         drop_temporary(tmp)
    >>> os.listdir(folder)
    []
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["Terminated", "guarded", "deferred", "make_temporary", "drop_temporary", "die_by_sigterm"]

#: Test hook: called with the name of each point a SIGTERM may land at (None: off).
_hook: Callable[[str], None] | None = None


def _at(point: str) -> None:
    if _hook is not None:
        _hook(point)


class Terminated(BaseException):
    """SIGTERM arrived during a save: unwind (removing temporaries), then end as SIGTERM would."""


class _State:
    """The process's save guard: the main thread's nesting, held signals, folders in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.folders: set[str] = set()  # temporaries of saves in flight, any thread
        self.depth = 0  # main-thread guards open with our handler installed
        self.deferring = 0  # main-thread deferred blocks open
        self.pending = False  # a SIGTERM arrived during a deferred block


_STATE = _State()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _on_sigterm(signum: int, frame: Any) -> None:
    if _STATE.deferring:
        _STATE.pending = True
        return
    raise Terminated()


def _raise_pending() -> None:
    if _STATE.pending and not _STATE.deferring:
        _STATE.pending = False
        raise Terminated()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A block a SIGTERM may not cut in half: one arriving there is raised when it ends
    (main thread, inside :func:`guarded`; elsewhere a plain block)."""
    if not _in_main_thread():
        yield
        return
    _STATE.deferring += 1
    try:
        yield
    finally:
        _STATE.deferring -= 1
        _raise_pending()


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Run a save so that SIGTERM unwinds it and then ends the process (see the module doc).

    Nested guards share the outermost one's handler. In another thread, or when the
    program set its own SIGTERM handler, it is a plain block.
    """
    if not _in_main_thread():
        yield
        return
    if _STATE.depth:
        _STATE.depth += 1
        try:
            yield
        finally:
            _STATE.depth -= 1
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        previous = None
    if previous is not signal.SIG_DFL:
        yield
        return
    try:
        _at("installing")
        with deferred():  # a SIGTERM while the handler goes in is held, then raised
            signal.signal(signal.SIGTERM, _on_sigterm)
            _STATE.depth = 1
            _at("installed")
        try:
            yield
        finally:
            with deferred():  # everything is removed by now: put the default action back
                _at("restoring")
                _STATE.depth = 0
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _at("restored")
    except Terminated:
        die_by_sigterm()
        raise


def make_temporary(folder: str | os.PathLike[str], prefix: str) -> Path:
    """Create a fresh folder ``<prefix><random>`` in ``folder``, registered (before it exists)
    as a temporary that a SIGTERM ending the process removes. Pair it with
    :func:`drop_temporary` in a ``finally``."""
    with deferred():
        _at("creating")
        while True:
            path = os.path.join(os.fspath(folder), prefix + secrets.token_hex(6))
            with _STATE.lock:
                _STATE.folders.add(path)
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:
                    _STATE.folders.discard(path)
                    continue
                except BaseException:
                    _STATE.folders.discard(path)
                    raise
            break
        _at("created")
    return Path(path)


def drop_temporary(path: str | os.PathLike[str]) -> None:
    """Remove a folder from :func:`make_temporary` and its contents (a SIGTERM waits)."""
    with deferred():
        _at("dropping")
        shutil.rmtree(path, ignore_errors=True)
        with _STATE.lock:
            _STATE.folders.discard(os.fspath(path))
        _at("dropped")


def die_by_sigterm() -> None:
    """Remove the temporaries of saves still in flight (other threads), then end the
    process by SIGTERM with its default action."""
    with _STATE.lock:  # held to the end: no thread makes a new temporary meanwhile
        for path in sorted(_STATE.folders):
            shutil.rmtree(path, ignore_errors=True)
        _STATE.folders.clear()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)  # delivered to this thread before it returns
