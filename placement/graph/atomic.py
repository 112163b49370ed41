"""Atomic file writes that never follow a link out of the target, and clean-up of killed saves.

A save writes under a temporary ``.placement-save-<pid>-<start>-...`` folder beside
its target and renames into place; a save killed half-way (``kill -9``) leaves that
folder behind, and the next save into the folder removes it once its owner is gone.
SIGTERM during a save cleans up as SIGINT does (:mod:`placement.graph.save_guard`).

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> write_atomic(os.path.join(folder, "a.json"), b"{}")
    >>> os.listdir(folder), clean_stale_temporaries(folder)  # nothing left behind
    (['a.json'], [])
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

from placement.errors import ModelSaveError
from placement.graph.save_guard import deferred, guarded

__all__ = ["write_atomic", "write_file", "clean_stale_temporaries"]

log = logging.getLogger(__name__)


def _save_target(path: Path, *, follow_symlinks: bool) -> Path:
    """The path a save replaces: ``path`` itself (a link there is replaced, not written
    through), or with ``follow_symlinks`` the file the link points to."""
    if follow_symlinks and path.is_symlink():
        return Path(os.path.realpath(path))
    return path


# --- temporary folders of saves --------------------------------------------------------

_TEMP_PREFIX = ".placement-save-"
_TEMP_OWNER = re.compile(re.escape(_TEMP_PREFIX) + r"(\d+)-(\d+)-")
#: A temporary folder whose name names no owner (older versions) is stale after this long.
_UNOWNED_STALE_SECONDS = 3600.0


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    try:  # the command name may hold spaces and parentheses: fields follow the last ')'
        return int(text[text.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _temporary_prefix() -> str:
    """``.placement-save-<pid>-<start time>-``: who owns a temporary folder, for clean-up."""
    pid = os.getpid()
    return f"{_TEMP_PREFIX}{pid}-{_start_time(pid) or 0}-"


def _owner_alive(pid: int, started: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    now = _start_time(pid)
    return now is None or started == 0 or now == started  # a reused pid has another start time


def clean_stale_temporaries(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary folders that killed saves left in ``folder``; return them.

    A folder named ``.placement-save-<pid>-<start>-...`` is stale when that process
    is gone (or the pid now belongs to a process started at another time); one
    from an older version, whose name names no owner, when it is over an hour old.

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> os.mkdir(os.path.join(folder, ".placement-save-999999999-1-abc"))
        >>> [p.name for p in clean_stale_temporaries(folder)]
        ['.placement-save-999999999-1-abc']
    """
    removed: list[Path] = []
    try:
        entries = [p for p in Path(folder).iterdir() if p.name.startswith(_TEMP_PREFIX)]
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode):
            continue
        owner = _TEMP_OWNER.match(entry.name)
        if owner is not None:
            stale = not _owner_alive(int(owner.group(1)), int(owner.group(2)))
        else:
            stale = now - info.st_mtime > _UNOWNED_STALE_SECONDS
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            if not os.path.lexists(entry):
                removed.append(entry)
                log.info("removed %s, left by a save that was killed", entry)
    return removed


def write_atomic(
    path: str | os.PathLike[str], data: bytes, *, what: str = "file", follow_symlinks: bool = False
) -> None:
    """Replace ``path`` with ``data`` atomically (a temporary file beside it, then ``os.replace``).

    A symlink at ``path`` is replaced by the new file (what it pointed to is left
    alone) unless ``follow_symlinks=True``, which writes the file it points to.
    An existing regular file keeps its permission bits; targets that are not
    regular files are refused. On any failure the old file is untouched and an
    ``OSError`` propagates (callers wrap it in their own error).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
        >>> write_atomic(path, b"{}")
        >>> open(path).read()
        '{}'
    """
    target = _save_target(Path(path), follow_symlinks=follow_symlinks)
    folder = target.parent if str(target.parent) else Path(".")
    mode = None
    if os.path.lexists(target) and not target.is_symlink():
        info = target.lstat()
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{str(path)!r} exists and is not a regular file; refusing to replace it")
        mode = stat.S_IMODE(info.st_mode)
    with guarded():
        tmp = None
        try:
            with deferred():  # the temporary exists only once its name is held here
                fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
            with deferred():
                os.replace(tmp, target)
                tmp = None
        finally:
            if tmp is not None:
                with deferred(), contextlib.suppress(OSError):
                    os.unlink(tmp)
    log.debug("wrote %s %s (%d bytes)", what, target, len(data))


def write_file(path: str | os.PathLike[str], data: bytes) -> None:
    """:func:`write_atomic` for user-facing outputs: any failure is a ``ModelSaveError``.

    Raises:
        ModelSaveError: the file cannot be written (the message names it); an old
            file at ``path`` is left as it was.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "out.txt")
        >>> write_file(path, b"hi")
        >>> write_file(os.path.join(path, "inside"), b"hi")
        Traceback (most recent call last):
        ...
        placement.errors.ModelSaveError: cannot write ...
    """
    try:
        write_atomic(path, data)
    except OSError as err:
        raise ModelSaveError(f"cannot write {str(path)!r}: {err}") from err


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
