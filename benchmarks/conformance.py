"""Benchmark: how much of ONNX's own node test suite each runtime passes.

Every case of ``onnx.backend.test.case.node`` (a one-op model, its inputs and
expected outputs, the suite's tolerances) runs on:

* ``ORT``: one plain ONNX Runtime session (the ceiling of this ORT build);
* ``placed ORT (last op)``: ``pl.run`` with the last op moved to logical device 1
  (copies injected, each logical device its own session, emulated on the CPU);
* ``placed ORT (every other op)``: every other op moved, so copies sit on many edges;
* ``pl.to_torch``: the lowered module called on the case inputs (forward only).

Outputs are compared as ONNX's backend runner does (``tests/conformance/_cases.py``).
The table shows cases passed of all cases, of the plain-tensor cases (no
sequences, optionals or strings), the pass count relative to plain ORT, and the
time the runtime took over the whole suite.

Usage::

    python benchmarks/conformance.py                      # all four runtimes
    python benchmarks/conformance.py --runtimes ort torch

Writes ``benchmarks/results/conformance.json``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import environment, write_results  # noqa: E402
from tests.conformance import _cases  # noqa: E402

__all__ = ["measure", "main"]

RESULTS = RESULTS_DIR / "conformance.json"
RUNTIMES = {
    "ort": "ORT (one session)",
    "placed_last": "placed ORT, last op moved",
    "placed_alternate": "placed ORT, every other op moved",
    "torch": "pl.to_torch",
}


def measure(runtime_name: str) -> dict[str, Any]:
    """Run the whole suite on one runtime: pass counts, failures and time."""
    cases = _cases.cases()
    start = time.perf_counter()
    failures = _cases.failures(runtime_name)
    seconds = time.perf_counter() - start
    tensors = [name for name, case in cases.items() if case.tensors_only]
    return {
        "runtime": runtime_name,
        "cases": len(cases),
        "passed": len(cases) - len(failures),
        "tensor_cases": len(tensors),
        "tensor_passed": sum(1 for name in tensors if name not in failures),
        "seconds": round(seconds, 2),
        "failed_cases": sorted(failures),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    ceiling = next((r["passed"] for r in rows if r["runtime"] == "ort"), None)
    header = ["runtime", "cases passed", "plain-tensor cases passed", "vs ORT", "time (s)"]
    lines = [header]
    for r in rows:
        ratio = f"{r['passed'] / ceiling:.3f}" if ceiling else "-"
        lines.append(
            [
                RUNTIMES.get(r["runtime"], r["runtime"]),
                f"{r['passed']} / {r['cases']}",
                f"{r['tensor_passed']} / {r['tensor_cases']}",
                ratio,
                f"{r['seconds']:.1f}",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=list(RUNTIMES))
    parser.add_argument("--output", type=Path, default=RESULTS)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("placement").setLevel(logging.ERROR)
    start = time.perf_counter()
    _cases.cases()
    print(f"loaded {len(_cases.cases())} node cases in {time.perf_counter() - start:.1f} s", flush=True)
    rows = []
    for name in ns.runtimes:
        rows.append(measure(name))
        print(f"{RUNTIMES[name]}: {rows[-1]['passed']} passed", flush=True)
    print(_table(rows))
    import onnx
    import onnxruntime
    import torch

    payload = {
        "environment": environment(),
        "versions": {
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__,
        },
        "results": rows,
    }
    write_results(ns.output, payload, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
