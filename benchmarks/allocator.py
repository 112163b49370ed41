"""The malloc a benchmark process runs with: tcmalloc or jemalloc preloaded, or glibc's arenas.

torch allocates every activation and gradient with ``malloc``; under glibc each pipeline worker
thread's arena is unmapped and faulted in again every training step (see
``benchmarks/pipeline.py``). :func:`choose` re-executes a benchmark with a caching allocator
preloaded (``LD_PRELOAD``), so every contender, baselines included, runs on it;
:func:`malloc_arena_max` is glibc's ``mallopt(M_ARENA_MAX, n)``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

__all__ = ["ALLOCATORS", "choose", "malloc_arena_max"]

log = logging.getLogger("benchmarks.allocator")

#: ``--allocator`` choices: malloc libraries preloaded by re-executing the benchmark (sonames).
ALLOCATORS = {"tcmalloc": "tcmalloc_minimal", "jemalloc": "jemalloc"}


def choose(choice: str, script: Path, argv: list[str]) -> str:
    """The allocator this process runs with; re-executes ``script`` with ``argv`` under
    ``LD_PRELOAD`` when ``choice`` (or, for ``auto``, the first of tcmalloc and jemalloc found)
    is not loaded yet."""
    if choice == "glibc":
        return "glibc"
    preloaded = os.environ.get("LD_PRELOAD", "")
    for name in ALLOCATORS if choice == "auto" else [choice]:
        soname = ctypes.util.find_library(ALLOCATORS[name])
        if soname is None:
            continue
        if soname in preloaded:
            return name
        if os.environ.get("PLACEMENT_BENCH_REEXEC"):  # preloading did not take: do not loop
            break
        env = dict(os.environ, LD_PRELOAD=f"{soname} {preloaded}".strip(), PLACEMENT_BENCH_REEXEC="1")
        print(f"re-running under {name} ({soname})", flush=True)
        os.execve(sys.executable, [sys.executable, str(script.resolve()), *argv], env)
    if choice != "auto":
        log.warning("allocator %s not found (apt install libtcmalloc-minimal4 / libjemalloc2): glibc", choice)
    return "glibc"


def malloc_arena_max(n: int) -> bool:
    """glibc's ``mallopt(M_ARENA_MAX, n)``; ``False`` where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-8, n))  # M_ARENA_MAX is -8 in glibc's malloc.h
    except (OSError, AttributeError):
        return False
