"""Benchmark: peak resident memory of each step on a model over 2 GiB, against its weights W.

Writes the synthetic MatMul chain of ``placement.models.synthetic`` (2.5 GiB of
float32 weights by default, in one external data file), then runs each pipeline
in a fresh process and measures every step's peak resident set size (Linux
``VmHWM``, reset before each step through ``/proc/self/clear_refs``):

* **placement**: ``pl.load`` (weights stay on disk, memory-mapped), shift the
  last layer to ``cuda:1`` + ``inject_cross_device_copies`` + ``verify``,
  ``save`` (weights streamed file to file); then ``pl.Runner`` (one ORT session
  per stage, weights handed over as ``OrtValue`` s, no protobuf), one run,
  ``auto_place`` with timed profiling, and ``pl.to_torch``;
* **baseline**: ``onnx.load`` (every weight read into memory) and one plain
  ``onnxruntime.InferenceSession`` of the file.

Target: load + place + save peak < 1.2 x W. Logical devices are emulated on the
CPU, so the session rows count each stage's weights once in host memory (on GPUs
they would go to the device). Memory-mapped pages a step has read count in RSS
(they are page cache and can be dropped by the kernel), so rows after a run
include them.

Usage::

    python benchmarks/bigmodel.py                 # 2.5 GiB (10 layers of 8192 x 8192)
    python benchmarks/bigmodel.py --layers 4      # 1 GiB, quicker

Writes ``benchmarks/results/bigmodel.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import environment, environment_line, process_bytes, write_results  # noqa: E402

RESULTS = RESULTS_DIR / "bigmodel.json"
TARGET = 1.2
_GIB = 2**30


def _step(rows: list[dict[str, Any]], name: str, fn: Callable[[], Any]) -> Any:
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    result = fn()
    rows.append(
        {
            "step": name,
            "peak": process_bytes("VmHWM"),
            "rss_after": process_bytes("VmRSS"),
            "seconds": time.perf_counter() - start,
        }
    )
    return result


def _child_placement(source: Path, work: Path) -> list[dict[str, Any]]:
    import numpy as np

    import placement as pl

    rows: list[dict[str, Any]] = []
    model = _step(rows, "pl.load", lambda: pl.load(source))

    def place() -> None:
        acts = pl.get_activation_blobs(model)
        pl.shift_activation_devices(model, acts[-2:], {0: 1})
        pl.inject_cross_device_copies(model)
        pl.verify(model)

    _step(rows, "shift + inject + verify", place)
    _step(rows, "save (external data)", lambda: model.save(work / "placed.onnx"))
    x = np.random.default_rng(1).standard_normal(model.value("x").shape.numpy(), dtype=np.float32)
    runners = [_step(rows, "pl.Runner (2 stage sessions)", lambda: pl.Runner(model, device_map="cpu"))]
    _step(rows, "Runner.run", lambda: runners[0].run({"x": x}))
    runners.clear()
    fresh = pl.load(source)
    _step(rows, "auto_place (timed profile)", lambda: pl.auto_place(fresh, devices=2, repeats=1))
    _step(rows, "pl.to_torch", lambda: pl.to_torch(fresh, device_map="cpu"))
    return rows


def _child_baseline(source: Path, work: Path) -> list[dict[str, Any]]:
    import numpy as np
    import onnx
    import onnxruntime as ort

    rows: list[dict[str, Any]] = []
    proto = _step(rows, "onnx.load (weights in memory)", lambda: onnx.load(str(source)))
    del proto
    session = _step(
        rows,
        "plain ORT InferenceSession(path)",
        lambda: ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]),
    )
    shape = [int(d) for d in session.get_inputs()[0].shape]
    x = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    _step(rows, "plain ORT run", lambda: session.run(None, {"x": x}))
    return rows


def _run_child(kind: str, source: Path, work: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--source", str(source), "--work", str(work)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{kind} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(weight_bytes: int, groups: dict[str, list[dict[str, Any]]]) -> Any:
    from rich.table import Table

    table = Table(title=f"peak resident memory per step, W = {weight_bytes / _GIB:.2f} GiB of weights")
    for col in ("pipeline", "step", "peak RSS", "peak / W", "RSS after", "seconds"):
        table.add_column(col, justify="left" if col in ("pipeline", "step") else "right")
    for group, rows in groups.items():
        for row in rows:
            table.add_row(
                group,
                row["step"],
                f"{row['peak'] / _GIB:.2f} GiB",
                f"{row['peak'] / weight_bytes:.2f}",
                f"{row['rss_after'] / _GIB:.2f} GiB",
                f"{row['seconds']:.1f}",
            )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Write the model, run both pipelines in fresh processes, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=10, help="MatMul layers (default 10)")
    parser.add_argument("--width", type=int, default=8192, help="layer width (default 8192)")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=["placement", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--source", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        child = _child_placement if ns.child == "placement" else _child_baseline
        print(json.dumps(child(ns.source, ns.work)))
        return 0

    from rich.console import Console

    from placement.models.synthetic import write_matmul_chain

    console = Console(width=None if sys.stdout.isatty() else 150)
    with tempfile.TemporaryDirectory(prefix="placement-bigmodel-", dir=ns.dir) as tmp:
        work = Path(tmp)
        source = work / "big.onnx"
        with console.status("writing the model..."):
            weight_bytes = write_matmul_chain(source, layers=ns.layers, width=ns.width)
        groups = {}
        for kind in ("placement", "baseline"):
            with console.status(f"{kind} pipeline..."):
                groups[kind] = _run_child(kind, source, work)
    pipeline = groups["placement"][:3]
    peak = max(row["peak"] for row in pipeline)
    env = environment()
    console.print(environment_line(env), highlight=False)
    console.print(_table(weight_bytes, groups))
    verdict = "meets" if peak < TARGET * weight_bytes else "MISSES"
    console.print(
        f"load + place + save: peak {peak / _GIB:.2f} GiB = {peak / weight_bytes:.2f} x W "
        f"({verdict} the {TARGET} x W target)"
    )
    payload = {
        "benchmark": "bigmodel",
        "target": {"load_place_save_peak_over_weights": TARGET},
        "environment": env,
        "weight_bytes": weight_bytes,
        "load_place_save_peak": peak,
        "results": groups,
    }
    write_results(ns.output, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
