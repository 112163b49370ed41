"""Benchmark: why several ONNX Runtime CUDA sessions in one process slow each other.

The report: on one H100 a placed big GPT (12 layers, d=1024, sequence 512, batch 8; two
stage sessions on ``cuda:0``) took 2.7-3.4 times one session of the unplaced model when
one more session lived in the process; alone, 26.2 ms against 24.6 ms. Each variant
below runs in a fresh process (forked from a server that imported torch, onnxruntime and
placement once, so a variant costs its own work only), under a timeout, and times
``--repeats`` runs after ``--warmup`` with device-resident I/O:

* ``single``; ``runner`` (``pl.Runner`` alone); ``runner+other_before`` /
  ``runner+other_after`` (one more session of the unplaced model made, and run once,
  before / after the Runner);
* ``chain`` / ``chain+other``: the two stage models in two sessions chained by hand
  through IOBinding (stage 0's output ``OrtValue`` bound as stage 1's input; no Runner
  code), without and with another session alive;
* ``profile:chain`` / ``profile:chain+other``: ONNX Runtime's per-node profile
  (``enable_profiling``) of the fast and the slow chain, per stage session and per run:
  node kernels, ``Memcpy`` nodes, and the rest of the run (waits: on a GPU mostly the
  end-of-run stream synchronisation);
* ``opt:*``: the slow chain with one provider or session option given to every session
  (:mod:`benchmarks.gpu_diagnose_options`);
* ``processes``: one process per stage, chained through shared memory
  (:mod:`benchmarks.gpu_diagnose_procs`).

``--dry-run`` runs every variant on the CPU provider with the tiny GPT and a few repeats
(options that need CUDA listed as skipped, with the reason) and prints the same table;
every run prints what the whole benchmark would take on the GPU, from its parts.

Usage::

    python benchmarks/gpu_diagnose.py               # on a GPU machine: big GPT, writes the JSON
    python benchmarks/gpu_diagnose.py --dry-run --out /tmp/diagnose.json

Writes ``benchmarks/results/gpu_diagnose.json`` (GPU runs; ``--out`` for any run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from benchmarks.gpu_diagnose_variants import VARIANTS, run_variant  # noqa: E402

__all__ = ["main", "prepare", "estimate_gpu_seconds"]

RESULTS = _ROOT / "benchmarks" / "results" / "gpu_diagnose.json"
#: The figures the GPU estimate is made of (seconds; run times in ms on one H100, from the report).
GPU_PARTS = {
    "export_s": 40.0,  # export + save of the big GPT, once (cached in --workdir afterwards)
    "server_s": 6.0,  # the fork server's imports
    "process_s": 1.5,  # a fresh process and its CUDA context
    "session_s": 2.0,  # one big-GPT-size session: load 640 MB, build, weights to the GPU
    "alone_ms": 26.0,
    "slowed_ms": 85.0,  # 3.4 x 24.6 ms, the worst reported
}
#: Imported once by the fork server, so a variant's process pays for its own work only.
_PRELOAD = ["torch", "onnxruntime", "placement", "placement.graph.loading", "placement.runtime.ort.runner",
            "placement.runtime.ort.sessions", "benchmarks.gpu_diagnose_variants",
            "benchmarks.gpu_diagnose_options", "benchmarks.gpu_diagnose_procs"]  # fmt: skip


def prepare(folder: Path, *, device: str, model: str, exported: tuple[Any, Any] | None = None) -> Path:
    """Export ``model`` (``big`` or ``tiny``: GPT), write the unplaced, placed (two halves) and
    stage models, the input and ``setup.json`` into ``folder``; reuse them when already there.
    ``exported``: ``(pl.Model, input tensor)`` already exported (no export here)."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "setup.json").exists():
        data = json.loads((folder / "setup.json").read_text())
        data["device"] = device
        (folder / "setup.json").write_text(json.dumps(data))
        return folder
    if exported is None:
        from benchmarks.gpu_setup import big_gpt, export, model_and_inputs

        net, args = big_gpt(8) if model == "big" else model_and_inputs("tiny-gpt", batch=8)
        exported = (export(net, args), args[0])
    _write(folder, device, *exported)
    return folder


def _write(folder: Path, device: str, unplaced: Any, x: Any) -> None:
    import numpy as np
    import onnx

    import placement as pl
    from placement.graph.saving import to_proto
    from placement.runtime.stages import partition

    placed = pl.place_evenly(unplaced.copy(), 2)
    onnx.save(to_proto(unplaced), folder / "single.onnx")
    placed.save(folder / "placed.onnx")
    stages = partition(placed)
    if len(stages) != 2:
        raise RuntimeError(f"the placed model has {len(stages)} stages, expected 2")
    for stage in stages:
        onnx.save(stage.to_proto(), folder / f"stage{stage.index}.onnx")
    sources = {op.outputs[0]: op.inputs[0] for op in placed.ops if op.op_type in ("Copy", "Identity")}
    np.save(folder / "input.npy", x.numpy())
    setup = {
        "device": device,
        "input_name": unplaced.inputs[0],
        "stage_inputs": [list(s.inputs) for s in stages],
        "stage_outputs": [list(s.outputs) for s in stages],
        "sources": {k: v for k, v in sources.items() if k in stages[1].inputs},
    }
    (folder / "setup.json").write_text(json.dumps(setup))


def _child(name: str, folder: str, warmup: int, repeats: int, conn: Any) -> None:
    try:
        conn.send(run_variant(name, Path(folder), warmup=warmup, repeats=repeats))
    except BaseException as err:  # noqa: BLE001 (reported in the table, the other variants go on)
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        conn.send({"error": last[:300]})


def run_all(
    names: Sequence[str], folder: Path, *, warmup: int, repeats: int, timeout: float
) -> dict[str, Any]:
    """Each variant in a fresh process (forked from the preloaded server), under ``timeout``."""
    context = start_server()
    results: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        receive, send = context.Pipe(duplex=False)
        proc = context.Process(target=_child, args=(name, str(folder), warmup, repeats, send), name=name)
        proc.start()
        send.close()
        if receive.poll(timeout):
            try:
                result = receive.recv()
            except EOFError:
                result = {"error": f"the process died (exit code {proc.exitcode})"}
        else:
            result = {"error": f"timed out after {timeout:.0f} s"}
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        result["wall_s"] = round(time.perf_counter() - start, 3)
        result["what"] = VARIANTS[name]
        results[name] = result
    base = results.get("single", {}).get("median_ms")
    for result in results.values():
        if base and "median_ms" in result:
            result["ratio_to_single"] = round(result["median_ms"] / base, 4)
    return results


def start_server() -> Any:
    """The fork server, started now (its imports overlap the export), with :data:`_PRELOAD`."""
    from multiprocessing import forkserver

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the server must not touch CUDA
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    forkserver.ensure_running()
    return context


def _sessions(name: str) -> int:
    """Big-GPT-size sessions a variant builds (two stage sessions make one)."""
    if name == "opt:cuda_graph":
        return 3
    return 2 if ("other" in name or name.startswith("opt:")) else 1


def estimate_gpu_seconds(names: Sequence[str], *, warmup: int, repeats: int) -> dict[str, Any]:
    """What the benchmark takes on one H100, from :data:`GPU_PARTS`: per variant a process,
    its sessions and its runs (the slowed run time where another session is alive)."""
    parts = {}
    for name in names:
        slowed = "other" in name or name.startswith("opt:")
        run_ms = GPU_PARTS["slowed_ms" if slowed else "alone_ms"] * (1.3 if name.startswith("profile") else 1)
        build = GPU_PARTS["process_s"] * (2 if name == "processes" else 1) + GPU_PARTS[
            "session_s"
        ] * _sessions(name)
        parts[name] = {"build_s": round(build, 2), "runs_s": round((warmup + repeats) * run_ms / 1e3, 2)}
    once = GPU_PARTS["export_s"] + GPU_PARTS["server_s"]
    total = once + sum(p["build_s"] + p["runs_s"] for p in parts.values())
    return {"once_s": once, "variants": parts, "total_s": round(total, 1)}


def _table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"ORT sessions in one process: {report['model']} GPT on {report['device']} "
                        f"({report['repeats']} runs, medians)")  # fmt: skip
    for column in ("variant", "what", "build s", "ms", "x single", "est. GPU s", "notes"):
        table.add_column(column)
    for name, row in report["variants"].items():
        ms = f"{row['median_ms']:.3f}" if "median_ms" in row else ""
        ratio = f"{row['ratio_to_single']:.3f}" if "ratio_to_single" in row else ""
        note = row.get("skipped") or row.get("error") or "; ".join(row.get("notes", []))
        if "profile" in row:
            note = (
                " | ".join(
                    f"stage {i}: kernels {p['kernel_ms']:.3f}, copies {p['copy_ms']:.3f}, "
                    f"wait {p['wait_ms']:.3f}"
                    for i, p in enumerate(row["profile"])
                )
                + " ms/run"
            )
        if "skipped" in row:
            note = f"skipped: {note}"
        build = f"{row['build_s']:.2f}" if "build_s" in row else ""
        part = report["estimate_gpu_s"]["variants"].get(name)
        estimate = f"{part['build_s'] + part['runs_s']:.1f}" if part else ""
        table.add_row(name, row["what"], build, ms, ratio, estimate, note)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU provider, tiny GPT, few repeats")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant (20; dry run 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (3; dry run 1)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per variant")
    parser.add_argument("--workdir", type=Path, default=None, help="where the models are written (reused)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    from benchmarks.gpu import has_gpu
    from benchmarks.harness import environment

    gpu = has_gpu() and not args.dry_run
    if not gpu and not args.dry_run:
        print(
            "benchmarks/gpu_diagnose.py: no CUDA GPU here (torch.cuda and onnxruntime's "
            "CUDAExecutionProvider); run it on a GPU machine, or use --dry-run.",
            file=sys.stderr,
        )
        return 0
    repeats = args.repeats or (20 if gpu else 3)
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    model = "big" if gpu else "tiny"
    workdir = args.workdir or Path(tempfile.gettempdir()) / f"placement-gpu-diagnose-{model}"
    start_server()
    prepared = time.perf_counter()
    prepare(workdir, device="cuda" if gpu else "cpu", model=model)
    prepared = time.perf_counter() - prepared
    variants = run_all(args.variants, workdir, warmup=warmup, repeats=repeats, timeout=args.timeout)
    report = {"environment": environment(), "device": "cuda:0" if gpu else "cpu (dry run)", "model": model,
              "repeats": repeats, "warmup": warmup, "prepare_s": round(prepared, 2), "variants": variants,
              "estimate_gpu_s": estimate_gpu_seconds(args.variants, warmup=3, repeats=20)}  # fmt: skip
    report["wall_s"] = round(time.perf_counter() - start, 2)
    from rich.console import Console

    console = Console(width=200)
    console.print(_table(report))
    est = report["estimate_gpu_s"]
    console.print(f"estimated GPU run (one H100, 20 runs per variant): {est['total_s']:.0f} s "
                  f"({est['once_s']:.0f} s export and server, then per variant build + runs); "
                  f"this run: {report['wall_s']:.1f} s")  # fmt: skip
    out = args.out or (RESULTS if gpu else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        console.print(f"wrote {out}")
    summary = {k: report[k] for k in ("device", "model", "wall_s")}
    summary["median_ms"] = {k: v.get("median_ms") for k, v in variants.items()}
    console.print_json(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
