"""Benchmark: the fixed cost of a stage call and of a micro-batch in ``pl.Runner``, side by side.

Two tables, each from contenders alternated run by run in one process (medians):

* **cost per stage call**: a zoo model (tiny by default: the fixed cost, not the compute, is
  what is measured) placed on 2 and 4 logical devices, run on the CPU through one plain
  ``InferenceSession`` of the whole model, through ``pl.Runner(device_map="cpu")`` (folded:
  one session) and through ``pl.Runner(device_map="cpu", fold=False)`` (one session per
  stage), with numpy inputs and outputs and with ``OrtValue`` s in and out (``outputs=
  "ortvalue"``, the CPU stand-in for device I/O). *runner* is what a Runner adds to one
  session (``T(folded) - T(single)``: the placement-change check, input checks, wrapping,
  outputs); *per call* is what each extra stage call costs (``(T(apart) - T(folded)) /
  (stages - 1)``).
* **cost per micro-batch**: 4 ``Linear(8, 8)`` in 2 stages, batch 64, one intra-op thread per
  stage: ``Runner(chunks=16).run`` against ``chunks=1`` (stages apart in both);
  ``(T16 - T1) / (16 * 2)`` is the cost per micro-batch per stage.
* **folded Runner.run against one session** (target: at most 1.02): a small GPT-2
  (``transformers``' ``GPT2LMHeadModel``, 4 layers, d=256, 4 heads, vocabulary 2048, batch 1,
  sequence 8; ``--gpt2-seq``), placed on 2 devices by ``pl.auto_place``, run by
  ``pl.Runner(device_map="cpu")`` (one session) against one plain ``InferenceSession`` of the
  unplaced graph with the same options, both numpy in and out, 1 intra-op thread, in
  alternating blocks of ``--block`` runs (the order flips each round); ``--trials`` fresh pairs,
  the median of their ratios (where a session's memory lands moves its speed by about 1% for
  its life).

Usage::

    python benchmarks/stage_calls.py                 # mlp and gpt, tiny
    python benchmarks/stage_calls.py --models gpt --size bench --repeats 300
    python benchmarks/stage_calls.py --only-folded --trials 5 --block 20   # the 1.02 target
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import placement as pl  # noqa: E402
from benchmarks.harness import alternate, environment, print_tables, table  # noqa: E402
from benchmarks.runtime import gpt2_logits  # noqa: E402
from placement import models  # noqa: E402
from placement.graph.saving import to_proto  # noqa: E402
from placement.runtime.device_map import PhysicalDevice  # noqa: E402
from placement.runtime.ort.sessions import session_options  # noqa: E402

__all__ = ["FOLDED_TARGET", "folded_rows", "main", "microbatch_row", "stage_call_rows"]

#: Target: a folded ``Runner.run`` over one plain session's run.
FOLDED_TARGET = 1.02


def _placed(name: str, size: str, devices: int) -> tuple[pl.Model, list[np.ndarray]]:
    net, args = models.build(name, size)
    model = pl.from_torch(net, args)
    pl.place_evenly(model, devices)
    pl.inject_cross_device_copies(model)
    return model, [a.numpy() for a in args]


def stage_call_rows(name: str, size: str, devices: int, repeats: int) -> list[dict[str, Any]]:
    """One row per I/O kind: medians of the single session, folded and apart runners."""
    model, arrays = _placed(name, size, devices)
    options = session_options(PhysicalDevice("cpu"), threads=1)
    single = ort.InferenceSession(
        to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [i.name for i in single.get_inputs()]
    feeds = dict(zip(names, arrays))
    values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feeds.items()}
    outs = [o.name for o in single.get_outputs()]
    folded = pl.Runner(model, device_map="cpu", threads=1)
    apart = pl.Runner(model, device_map="cpu", threads=1, fold=False)
    stages = len(apart.stages)
    ort_values = [values[n] for n in names]
    native = single._sess.run_with_ort_values  # what a Runner's CPU stage calls
    rows = []
    for io, fns in (
        (
            "numpy",
            {
                "single": lambda: single.run(None, feeds),
                "folded": lambda: folded.run(arrays),
                "apart": lambda: apart.run(arrays),
            },
        ),
        (
            "OrtValue",
            {
                "single": lambda: native({k: v._ortvalue for k, v in values.items()}, outs, None),
                "folded": lambda: folded.run(ort_values, outputs="ortvalue"),
                "apart": lambda: apart.run(ort_values, outputs="ortvalue"),
            },
        ),
    ):
        med = alternate(fns, repeats, warmup=20).medians()
        rows.append(
            {
                "model": f"{name} ({size})",
                "stages": stages,
                "io": io,
                **{k: v * 1e6 for k, v in med.items()},
                "overhead": (med["folded"] - med["single"]) * 1e6,
                "per_call": (med["apart"] - med["folded"]) / max(1, stages - 1) * 1e6,
            }
        )
    return rows


def microbatch_row(repeats: int) -> dict[str, Any]:
    """4 Linear(8, 8) in 2 stages, batch 64: ``chunks=16`` against ``chunks=1``."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).eval()
    x = torch.randn(64, 8)
    model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    xs = [x.numpy()]
    one = pl.Runner(model, device_map="cpu", threads_per_stage=1, fold=False)
    piped = pl.Runner(model, device_map="cpu", chunks=16, threads_per_stage=1)
    np.testing.assert_allclose(piped.run(xs)[0], one.run(xs)[0], atol=1e-5)
    fns = {"chunks1": lambda: one.run(xs), "chunks16": lambda: piped.run(xs)}
    med = alternate(fns, repeats, warmup=20).medians()
    return {
        "chunks1": med["chunks1"] * 1e6,
        "chunks16": med["chunks16"] * 1e6,
        "per_mb_stage": (med["chunks16"] - med["chunks1"]) / 32 * 1e6,
    }


def folded_rows(seq: int, repeats: int, block: int, trials: int) -> list[dict[str, Any]]:
    """Per trial (fresh sessions): medians (us) of one plain session (``single``), the folded
    Runner's own session called as a plain one (``session``), the folded ``Runner.run``
    (``folded``), the same without the per-run placement check (``no check``:
    ``auto_update=False``), and the Runner's Python per run (``python``, see
    :func:`_runner_python`)."""
    net, args = gpt2_logits(4, 256, 4, seq, 1)  # a small GPT-2: 4 layers, d=256, batch 1
    model = pl.from_torch(net, args)
    placed = model.copy()
    pl.auto_place(placed, devices=2, cost="flops")
    proto = to_proto(model).SerializeToString()
    feeds = {name: a.numpy().copy() for name, a in zip(model.inputs, args)}
    rows = []
    for _ in range(trials):
        options = session_options(PhysicalDevice("cpu"), threads=1)
        single = ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
        runner = pl.Runner(placed, device_map="cpu", threads=1)
        still = pl.Runner(placed, device_map="cpu", threads=1, auto_update=False)
        (step,) = [step for step in runner.program.steps if hasattr(step, "exec")]
        own = step.exec.session
        np.testing.assert_allclose(runner.run(feeds)[0], single.run(None, feeds)[0], atol=1e-4)
        fns = {
            "single": functools.partial(single.run, None, feeds),
            "session": functools.partial(
                own.run, None, dict(zip([i.name for i in own.get_inputs()], feeds.values()))
            ),
            "folded": functools.partial(runner.run, feeds),
            "no check": functools.partial(still.run, feeds),
        }
        med = alternate(fns, repeats, warmup=20, block=block).medians()
        row = {name: seconds * 1e6 for name, seconds in med.items()}
        row["ratio"] = med["folded"] / med["single"]
        row["python"] = _runner_python(runner, feeds, repeats * 10) * 1e6
        rows.append(row)
    return rows


def _runner_python(runner: pl.Runner, feeds: dict[str, np.ndarray], runs: int) -> float:
    """Seconds of this thread's CPU time per ``runner.run(feeds)`` with its one session's native
    run replaced by one handing back that session's last outputs: the Runner's own Python
    (checks, feeding, collecting), warm, and unmoved by other processes' load."""
    (step,) = [step for step in runner.program.steps if hasattr(step, "exec")]
    ex = step.exec
    real = ex.direct
    if real is None:
        return float("nan")
    last: list[Any] = []

    def record(*args: Any) -> Any:
        last[:] = [real(*args)]
        return last[0]

    try:
        ex.direct = record
        runner.run(feeds)
        ex.direct = lambda *args: last[0]
        for _ in range(100):
            runner.run(feeds)
        start = time.thread_time()
        for _ in range(runs):
            runner.run(feeds)
        return (time.thread_time() - start) / runs
    finally:
        ex.direct = real


def _folded_table(ns: argparse.Namespace) -> Any:
    rows = folded_rows(ns.gpt2_seq, ns.repeats, ns.block, ns.trials)
    cells = [
        (
            str(i), f"{r['single']:.0f}", f"{r['session']:.0f}", f"{r['folded']:.0f}", f"{r['no check']:.0f}",
            f"{r['python']:.1f}", f"{r['ratio']:.3f}", f"{r['folded'] / r['session']:.3f}",
            f"{1 + r['python'] / r['single']:.3f}",
        )
        for i, r in enumerate(rows)
    ]  # fmt: skip
    ratio = statistics.median(r["ratio"] for r in rows)
    own = statistics.median(r["folded"] / r["session"] for r in rows)
    cells.append(("median", "", "", "", "", "", f"{ratio:.3f}", f"{own:.3f}", ""))
    return table(
        f"folded Runner.run / one session: GPT-2 4 x 256, batch 1, seq {ns.gpt2_seq}, 1 thread, "
        f"alternating blocks of {ns.block} (medians in us; target <= {FOLDED_TARGET}). session: the "
        "Runner's own session run as a plain one; no check: auto_update=False; runner python: "
        "the Runner's CPU time per run with its session's run replayed (warm)",
        ("trial", "single", "session", "folded", "no check", "runner python", "folded / single",
         "folded / session", "1 + python / single"),
        cells,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--devices", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--block", type=int, default=10, help="runs per block (folded table)")
    parser.add_argument("--trials", type=int, default=3, help="fresh pairs (folded table)")
    parser.add_argument("--gpt2-seq", type=int, default=8)
    parser.add_argument("--only-folded", action="store_true", help="the folded / single table alone")
    ns = parser.parse_args(argv)
    env = environment(threads=1)
    if ns.only_folded:
        print_tables(_folded_table(ns), env=env, width=150)
        return
    calls = table(
        "cost per stage call (CPU, 1 intra-op thread; medians in us)",
        ("model", "stages", "io", "single", "folded", "apart", "runner", "per call"),
        [
            (row["model"], row["stages"], row["io"], f"{row['single']:.0f}", f"{row['folded']:.0f}",
             f"{row['apart']:.0f}", f"{row['overhead']:.1f}", f"{row['per_call']:.1f}")
            for name in ns.models
            for devices in ns.devices
            for row in stage_call_rows(name, ns.size, devices, ns.repeats)
        ],
    )  # fmt: skip
    row = microbatch_row(ns.repeats)
    micro = table(
        "cost per micro-batch (4 Linear(8, 8), 2 stages, batch 64, 1 thread per stage; us)",
        ("chunks=1", "chunks=16", "per micro-batch per stage"),
        [(f"{row['chunks1']:.0f}", f"{row['chunks16']:.0f}", f"{row['per_mb_stage']:.1f}")],
    )
    print_tables(calls, micro, _folded_table(ns), env=env, width=150)


if __name__ == "__main__":
    main()
