"""The variants of ``benchmarks/gpu_diagnose.py``: each one runs in a fresh process.

A variant builds its sessions from the files the driver prepared (the unplaced model,
the placed model and its two stage models, the input), times ``warmup + repeats`` runs
with device-resident I/O (on a GPU: the input an ``OrtValue`` on the GPU, outputs bound
to the GPU; on the CPU the same calls with ``"cpu"``) and returns a JSON-ready dict:
``build_s``, ``run_ms`` (every timed run), ``median_ms``, ``notes``, and for the
profiled variants ``profile`` (per session: kernel, copy and wait milliseconds per run).

Sessions are built here with plain ONNX Runtime calls; only the ``runner*`` variants use
``pl.Runner``. Session and provider options start from the ones ``pl.Runner`` gives its
stage sessions (``placement.runtime.ort.sessions``), so the hand-chained stages differ
from the Runner's in the Runner's own code only.
"""

from __future__ import annotations

import inspect
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnxruntime as ort

from benchmarks.gpu_diagnose_sessions import (
    Chain,
    Setup,
    bind_run,
    device_of,
    make_session,
    other_session,
    stage_sessions,
)
from benchmarks.harness import alternate

__all__ = ["OPTION_VARIANTS", "VARIANTS", "run_variant"]

#: Options tried one at a time on the slow configuration (two stage sessions chained by
#: hand, another session alive); every session of the process gets the option.
OPTION_VARIANTS = {
    "opt:user_compute_stream": "one torch.cuda.Stream shared by every session (user_compute_stream)",
    "opt:copy_in_default_stream=0": "do_copy_in_default_stream=0",
    "opt:arena_next_power_of_two": "arena_extend_strategy=kNextPowerOfTwo (ORT's default)",
    "opt:shared_arena": "one registered arena (create_and_register_allocator_v2 + use_env_allocators)",
    "opt:cudnn_heuristic": "cudnn_conv_algo_search=HEURISTIC",
    "opt:one_thread_no_spin": "intra_op_num_threads=1, session.intra_op.allow_spinning=0",
    "opt:cuda_graph": "enable_cuda_graph on each stage (fixed I/O buffers)",
    "opt:dedicated_thread": "the chain run on one long-lived thread",
    "opt:torch_allocator": "gpu_external_alloc/free/empty_cache from torch's caching allocator",
}

#: Every variant, in the table's order, with what it is.
VARIANTS = {
    "single": "one session of the unplaced model, alone",
    "runner": "pl.Runner (2 stages, one device), alone",
    "runner+other_before": "pl.Runner, another session created (and run) before it",
    "runner+other_after": "pl.Runner, another session created (and run) after it",
    "chain": "2 stage sessions chained by hand (IOBinding), alone",
    "chain+other": "2 stage sessions chained by hand, another session alive",
    "profile:chain": "ORT per-node profile of the chain, alone (fast)",
    "profile:chain+other": "ORT per-node profile of the chain, another session alive (slow)",
    **OPTION_VARIANTS,
    "processes": "one process per stage, chained through shared memory",
}


def _single_call(setup: Setup, session: ort.InferenceSession) -> Callable[[], Any]:
    value = ort.OrtValue.ortvalue_from_numpy(setup.feed(), *device_of(setup))
    return lambda: bind_run(session, {setup.input_name: value}, device_of(setup))


def _runner_call(setup: Setup) -> Callable[[], Any]:
    import placement as pl

    model = pl.load(setup.path("placed.onnx"))
    options: dict[str, Any] = {"device_map": {0: "cuda:0", 1: "cuda:0"} if setup.cuda else "cpu"}
    if "fold" in inspect.signature(pl.Runner).parameters:
        options["fold"] = False  # two stage sessions on the one GPU, as in the report
    runner = pl.Runner(model, **options)
    if setup.cuda:
        import torch

        x = torch.from_numpy(setup.feed()).cuda()
        return lambda: runner.run([x], outputs="torch")
    feed = setup.feed()
    return lambda: runner.run([feed])


# --- timing --------------------------------------------------------------------------------------


def _sync(setup: Setup) -> None:
    if setup.cuda:
        import torch

        torch.cuda.synchronize()


def _time(setup: Setup, fn: Callable[[], Any], *, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` (after ``warmup``), each synchronised."""
    timings = alternate({"run": fn}, repeats, warmup=warmup, sync=lambda: _sync(setup))
    return [spent * 1e3 for spent in timings.wall["run"]]


def run_variant(name: str, folder: Path, *, warmup: int, repeats: int) -> dict[str, Any]:
    """Build and time variant ``name`` (a key of :data:`VARIANTS`) in this process."""
    setup = Setup.load(folder)
    keep: list[Any] = []
    notes: list[str] = []
    start = time.perf_counter()
    if name == "processes":
        from benchmarks.gpu_diagnose_procs import time_processes

        return time_processes(setup, warmup=warmup, repeats=repeats)
    fn = _build(name, setup, keep, notes)
    built = time.perf_counter() - start
    if fn is None:
        return {"skipped": "; ".join(notes), "build_s": round(built, 3)}
    runs = _time(setup, fn, warmup=warmup, repeats=repeats)
    result: dict[str, Any] = {"build_s": round(built, 3), "run_ms": [round(r, 4) for r in runs],
                              "median_ms": round(statistics.median(runs), 4), "notes": notes}  # fmt: skip
    if name.startswith("profile:"):
        result["profile"] = [
            summarise_profile(s.end_profiling(), runs=warmup + repeats) for s in keep[0].sessions
        ]
    return result


def _build(name: str, setup: Setup, keep: list[Any], notes: list[str]) -> Callable[[], Any] | None:
    """The call to time for ``name``; objects to keep alive go to ``keep``, what to say to ``notes``."""
    if name == "single":
        single = make_session(setup, setup.path("single.onnx"))
        keep.append(single)
        return _single_call(setup, single)
    if name.startswith("runner"):
        if name.endswith("before"):
            keep.append(other_session(setup))
        fn = _runner_call(setup)
        if name.endswith("after"):
            keep.append(other_session(setup))
        return fn
    if name in ("chain", "chain+other", "profile:chain", "profile:chain+other"):
        profile = setup.path(name.replace(":", "_").replace("+", "_")) if name.startswith("profile") else None
        chain = Chain(setup, stage_sessions(setup, profile=profile))
        keep.append(chain)
        if name.endswith("+other"):
            keep.append(other_session(setup))
        return chain
    if name in OPTION_VARIANTS:
        from benchmarks.gpu_diagnose_options import build_option

        return build_option(name, setup, keep, notes)
    raise ValueError(f"unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")


# --- profiles ------------------------------------------------------------------------------------


def summarise_profile(path: str, *, runs: int) -> dict[str, Any]:
    """Per run, the milliseconds of ONNX Runtime's profile of one session spent in node
    kernels (``kernel_ms``: on a GPU the host time of each node's launch, which includes an
    allocation that misses the arena), in ``Memcpy*`` nodes (``copy_ms``), and the rest of
    each ``model_run`` (``wait_ms``: on a GPU mostly the end-of-run stream synchronisation,
    i.e. waiting for the device), with the five costliest op types."""
    events = json.loads(Path(path).read_text())
    run_us = kernel_us = copy_us = 0.0
    by_op: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            run_us += event.get("dur", 0)
        elif event.get("cat") == "Node" and str(event.get("name", "")).endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            dur = event.get("dur", 0)
            by_op[op] = by_op.get(op, 0.0) + dur
            if op.startswith("Memcpy"):
                copy_us += dur
            else:
                kernel_us += dur
    scale = 1e-3 / max(1, runs)
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:5]
    wait_us = max(0.0, run_us - kernel_us - copy_us)
    return {
        "run_ms": round(run_us * scale, 4),
        "kernel_ms": round(kernel_us * scale, 4),
        "copy_ms": round(copy_us * scale, 4),
        "wait_ms": round(wait_us * scale, 4),
        "top_ops_ms": {op: round(us * scale, 4) for op, us in top},
    }
