"""What every benchmark shares: alternating timed blocks, the environment, tables, results.

Each benchmark module keeps only what it measures; this module holds the rest:

* :func:`alternate`: contenders timed in alternating blocks (the order flips every round, so
  load from other processes hits all of them), wall and process CPU seconds per call;
  :class:`Timings` holds them, :func:`median_ms` reads them;
* :func:`environment` and :func:`environment_line`: the machine, the versions of the
  libraries measured, the load average, as a results field and as the line a run prints;
* :func:`table` and :func:`print_tables`: the rich tables each run prints;
* :func:`write_results`: ``benchmarks/results/<name>.json``, written atomically.

Example:
    >>> timings = alternate({"a": lambda: None, "b": lambda: None}, repeats=4, warmup=0, block=2)
    >>> [len(timings.wall[k]) for k in ("a", "b")], sorted(timings.medians())
    ([4, 4], ['a', 'b'])
    >>> env = environment(threads=1)
    >>> env["threads"], "load_average" in env, environment_line(env).startswith("machine: ")
    (1, True, True)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS",
    "ROOT",
    "Timings",
    "alternate",
    "environment",
    "environment_line",
    "median_ms",
    "print_tables",
    "process_bytes",
    "table",
    "write_results",
]

#: The repository root and the folder of committed results.
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: Distributions whose versions a results file records (those installed).
VERSIONS = ("torch", "onnxruntime-gpu", "onnxruntime", "onnx", "onnx-ir", "onnxscript", "transformers")


@dataclass
class Timings:
    """Seconds per call of each contender: wall clock and process CPU time (all threads)."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def medians(self) -> dict[str, float]:
        """Median wall seconds per call, by contender."""
        return {name: statistics.median(times) for name, times in self.wall.items()}

    def cpu_medians(self) -> dict[str, float]:
        """Median process CPU seconds per call, by contender (CPU / wall is the parallelism)."""
        return {name: statistics.median(times) for name, times in self.cpu.items()}


def alternate(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int,
    *,
    warmup: int = 1,
    block: int = 1,
    sync: Callable[[], None] | None = None,
) -> Timings:
    """Time each function ``repeats`` times, in blocks of ``block`` calls of each, alternating
    (the order flips every round), after ``warmup`` calls of each.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each timed call and inside its
    timing, so a call's asynchronous device work counts.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if sync is not None:
        sync()
    timings = Timings({name: [] for name in fns}, {name: [] for name in fns})
    items = list(fns.items())
    block = max(1, block)
    for i in range(-(-repeats // block)):
        for name, fn in items if i % 2 == 0 else reversed(items):
            for _ in range(block):
                start, cpu_start = time.perf_counter(), time.process_time()
                fn()
                if sync is not None:
                    sync()
                timings.wall[name].append(time.perf_counter() - start)
                timings.cpu[name].append(time.process_time() - cpu_start)
    return timings


def median_ms(values: Sequence[float]) -> float:
    """The median of ``values`` (seconds) in milliseconds."""
    return statistics.median(values) * 1e3


def process_bytes(key: str) -> int:
    """A size this process's ``/proc/self/status`` reports (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _versions() -> dict[str, str]:
    found = {}
    for dist in VERSIONS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def _gpus() -> list[str]:
    """CUDA device names, when torch is already imported (never imported here for it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def environment(**extra: Any) -> dict[str, Any]:
    """The environment a run measured in: machine, Python, library versions, CPUs, GPUs and the
    load average now (1, 5, 15 minutes), plus ``extra`` (threads, allocator, ...)."""
    env: dict[str, Any] = {
        "machine": f"{platform.system()}-{platform.machine()}",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": _versions(),
        "cpus": os.cpu_count(),
        "gpus": _gpus(),
        "load_average": _load_average(),
    }
    env.update(extra)
    return env


def environment_line(env: Mapping[str, Any]) -> str:
    """One line for a run's output: the machine, versions and load of :func:`environment`."""
    versions = ", ".join(f"{name} {version}" for name, version in env.get("versions", {}).items())
    gpus = f", GPUs: {', '.join(env['gpus'])}" if env.get("gpus") else ""
    load = env.get("load_average")
    loads = " ".join(f"{v:.2f}" for v in load) if load else "unknown"
    return (
        f"machine: {env.get('machine')} ({env.get('cpus')} CPUs{gpus}), python {env.get('python')}, "
        f"{versions}; load average {loads}"
    )


def table(title: str, columns: Iterable[str], rows: Iterable[Sequence[Any]] = ()) -> Any:
    """A rich ``Table`` titled ``title`` with these columns (right-justified but the first)
    and rows (each cell shown with ``str``)."""
    from rich.table import Table

    out = Table(title=title)
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*(str(cell) for cell in row))
    return out


def print_tables(*tables: Any, env: Mapping[str, Any] | None = None, width: int | None = None) -> None:
    """Print the tables (and, given ``env``, its :func:`environment_line` first) on stdout."""
    from rich.console import Console

    console = Console(width=width)
    if env is not None:
        console.print(environment_line(env), highlight=False)
    for one in tables:
        console.print(one)


def write_results(
    path: Path, payload: Mapping[str, Any], *, indent: int | None = 2, sort_keys: bool = False
) -> None:
    """Write ``payload`` as JSON to ``path`` atomically (a temporary beside it, then a rename),
    creating its folder, and say so on stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=indent, sort_keys=sort_keys, default=str) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
