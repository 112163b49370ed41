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

Usage::

    python benchmarks/stage_calls.py                 # mlp and gpt, tiny
    python benchmarks/stage_calls.py --models gpt --size bench --repeats 300
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import placement as pl  # noqa: E402
from benchmarks.harness import alternate, environment, print_tables, table  # noqa: E402
from placement import models  # noqa: E402
from placement.graph.saving import to_proto  # noqa: E402
from placement.runtime.device_map import PhysicalDevice  # noqa: E402
from placement.runtime.ort.sessions import session_options  # noqa: E402

__all__ = ["stage_call_rows", "microbatch_row", "main"]


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--devices", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--repeats", type=int, default=200)
    ns = parser.parse_args(argv)
    env = environment(threads=1)
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
    print_tables(calls, micro, env=env)


if __name__ == "__main__":
    main()
