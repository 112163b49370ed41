"""Benchmark: peak memory of a pipelined training step, GPipe against ``train_step`` (1F1B).

``loss_fn(module(x)).backward()`` on a pipelined module is GPipe: every
micro-batch's activations are held until the caller's loss exists.
``module.train_step(x, loss_fn=...)`` back-propagates each micro-batch as soon
as its forward ends (1F1B), so a stage holds only the micro-batches between a
forward and its backward; ``max_in_flight`` bounds them. This measures what
that means for memory, on bench-size ``gpt`` and ``resnet`` placed on two
logical devices (``auto_place(devices=2, cost="flops")``), ``chunks=8``,
``checkpoint="never"``, one thread per stage, as ``benchmarks/pipeline.py`` runs
them.

Every contender runs in a fresh process: the model is built, placed and
lowered, the resident set size is read (the *base*), the peak counter is reset
(Linux ``VmHWM`` through ``/proc/self/clear_refs``), three training steps run,
and the peak above the base is reported: the memory a training step needs on
top of the model (activations, gradients, the allocator's caches, and for the
pipelined contenders their TorchScript traces, recorded in the first steps).
The eager module's step is the baseline. The same allocator as
``benchmarks/pipeline.py`` (tcmalloc when installed) is preloaded for all.

Usage::

    python benchmarks/training_memory.py            # both models
    python benchmarks/training_memory.py --models gpt
    python benchmarks/training_memory.py --size tiny --out /tmp/m.json   # a smoke run

Writes ``benchmarks/results/training_memory.json``.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import environment, print_tables, process_bytes, write_results  # noqa: E402

RESULTS = RESULTS_DIR / "training_memory.json"
CHUNKS = 8
STEPS = 3
#: contender -> (label, how its step is taken)
CONTENDERS = {
    "eager": "eager module, loss.backward()",
    "gpipe": "to_torch(chunks=8), loss_fn(module(x)).backward() (GPipe)",
    "train_step": "to_torch(chunks=8).train_step(x, loss_fn=...) (1F1B)",
    "train_step_bounded": "train_step(..., max_in_flight=2)",
}
_MIB = 2**20


def _child(model_name: str, contender: str, size: str = "bench") -> dict[str, Any]:
    """One contender in this (fresh) process: base RSS and the peak of three steps above it."""
    import gc

    import torch

    import placement as pl
    from placement.models import gpt, resnet

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, (x,) = {"gpt": gpt, "resnet": resnet}[model_name].build(size)
    net = net.eval()
    sample = int(x.shape[0])
    x = torch.cat([x] * CHUNKS).contiguous()

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().square().mean()

    module: Any = net
    if contender != "eager":
        model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        pl.auto_place(model, devices=2, cost="flops", sample_inputs=[x[:sample]])
        pl.inject_cross_device_copies(model)
        module = pl.to_torch(model, device_map="cpu", chunks=CHUNKS, checkpoint="never")

    def step() -> None:
        module.zero_grad(set_to_none=True)
        if contender in ("eager", "gpipe"):
            loss_fn(module(x)).backward()
        else:
            bound = 2 if contender == "train_step_bounded" else None
            module.train_step(x, loss_fn=loss_fn, max_in_flight=bound)

    gc.collect()
    base = process_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM to the current RSS
    for _ in range(STEPS):
        step()
    return {
        "base_mib": base / _MIB,
        "peak_mib": process_bytes("VmHWM") / _MIB,
        "step_mib": (process_bytes("VmHWM") - base) / _MIB,
    }


def _preload() -> tuple[dict[str, str], str]:
    """The environment for the children: tcmalloc (else jemalloc) preloaded, as pipeline.py does."""
    from benchmarks.allocator import ALLOCATORS

    for name, soname in ALLOCATORS.items():
        found = ctypes.util.find_library(soname)
        if found:
            preload = f"{found} {os.environ.get('LD_PRELOAD', '')}".strip()
            return dict(os.environ, LD_PRELOAD=preload), name
    return dict(os.environ), "glibc"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"], choices=["gpt", "resnet"])
    parser.add_argument("--size", default="bench", choices=["bench", "tiny"], help="tiny: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS), help="default: all"
    )
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "CONTENDER", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    env, allocator = _preload()
    results: list[dict[str, Any]] = []
    for model_name in args.models:
        for contender in args.contenders:
            print(f"{model_name}: {contender} ...", flush=True)
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", model_name, contender, args.size],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results.append({"model": model_name, "contender": contender, **row})

    from rich.table import Table

    table = Table(title=f"peak memory of {STEPS} training steps above the built model (MiB), {allocator}")
    for col in ("model", "contender", "step peak above base", "/ GPipe", "/ eager", "base RSS"):
        table.add_column(col)
    for row in results:
        same = {r["contender"]: r["step_mib"] for r in results if r["model"] == row["model"]}
        table.add_row(
            row["model"],
            CONTENDERS[row["contender"]],
            f"{row['step_mib']:.0f}",
            f"{row['step_mib'] / same['gpipe']:.2f}" if same.get("gpipe") else "",
            f"{row['step_mib'] / same['eager']:.2f}" if same.get("eager") else "",
            f"{row['base_mib']:.0f}",
        )
    env = environment(allocator=allocator)
    print_tables(table, env=env, width=140)
    payload = {
        "environment": env,
        "size": args.size,
        "chunks": CHUNKS,
        "steps": STEPS,
        "results": results,
    }
    write_results(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
