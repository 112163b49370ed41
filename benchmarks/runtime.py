"""Benchmark: the cost of placement in both runtimes, side by side in one run.

For each model (bench size by default) the network is imported, split across
``devices`` logical devices by each plan of ``--plans`` (``half``: Caffe2 style,
activations shifted in equal runs; ``auto``: ``pl.auto_place`` with its defaults,
measured op times, link model and fusion-aware cuts), copies are injected, and it
is timed:

* **ONNX Runtime**: ``pl.Runner`` (one session per stage, IOBinding between
  stages) against *one* ``InferenceSession`` of the unplaced model with the same
  session options. Target: placed / single <= 1.02.
* **torch**: ``pl.to_torch`` against the original eager module, measured by
  ``benchmarks/torch_lowering.py: measure`` (imported, so both tables come from
  one process and one invocation). Target: lowered / eager <= 1.10.

The two contenders of each pair alternate run by run (the order flips every
iteration), so drift and other load on the machine hit both; latencies are
medians. Without GPUs every logical device is emulated on the CPU with its own
sessions, so the ONNX Runtime ratio measures what placement itself costs:
extra sessions, lost fusions at the cut, transfers (handovers: emulated devices
share host memory, so nothing is copied), Python glue.

``--explain`` adds, per row, the placed run's overhead over the single session by
cause (medians of runs alternated with the single session, each cause timed on its
own): *cut* (the stage sessions' compute beyond the single session's: fusions and
layout conversions lost at the cuts, extra kernel launches), *transfers* (moving
blobs between devices), *binding* (per stage and run: gathering its inputs and storing
its outputs, with IOBinding set-up on a GPU), *checks* (the placement-change check and
input validation) and *outputs* (handing outputs back as arrays); *other* is what
remains (Python between the steps, and the noise of medians taken apart).

Models are the zoo's (``placement.models``) or, from outside the zoo, ``hf-gpt2``:
Hugging Face's ``GPT2LMHeadModel`` (randomly initialised from a config, nothing is
downloaded; bench size: 6 layers, d=256, 4 heads, sequence 128, batch 2, vocabulary 2048, like the zoo's
gpt), written without any of our code. It needs the optional ``transformers`` package
(``pip install transformers``; a benchmark extra, never a requirement of the library).
``--block N`` alternates blocks of N runs instead of single runs (steady state).
``--trials K`` (default 5) times K fresh pairs of contenders, ``--repeats`` runs each,
and reports the median of their ratios: where a session's memory lands moves its
speed by about 1% for its whole life, more than the repeats of one pair average out.

Usage::

    python benchmarks/runtime.py                       # gpt and resnet, bench, 2 devices
    python benchmarks/runtime.py --models hf-gpt2 --no-torch --threads 1 --block 5
    python benchmarks/runtime.py --models gpt mlp resnet unet --devices 2 4 --repeats 50
    python benchmarks/runtime.py --no-torch --explain --plans half auto

Writes ``benchmarks/results/runtime.json``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import placement as pl  # noqa: E402
from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import alternate, environment, print_tables, write_results  # noqa: E402
from placement import models  # noqa: E402
from placement.graph.saving import to_proto  # noqa: E402
from placement.runtime.ort.sessions import providers, session_options  # noqa: E402

__all__ = ["measure_ort", "main", "ORT_TARGET", "TORCH_TARGET"]

log = logging.getLogger("benchmarks.runtime")

RESULTS = RESULTS_DIR / "runtime.json"
ORT_TARGET = 1.02
TORCH_TARGET = 1.10


def hf_gpt2(size: str = "bench", *, seed: int = 0) -> tuple[Any, tuple[Any, ...]]:
    """Hugging Face's GPT-2 language model (needs ``transformers``), randomly initialised.

    Returns ``(module, (token ids,))`` like ``placement.models.build``; the module
    returns the logits. Raises ImportError without ``transformers``.
    """
    layers, width, heads, seq, batch = {"tiny": (2, 64, 4, 16, 2)}.get(size, (6, 256, 4, 128, 2))
    return gpt2_logits(layers, width, heads, seq, batch, seed=seed)


def gpt2_logits(
    layers: int, width: int, heads: int, seq: int, batch: int, *, seed: int = 0
) -> tuple[Any, tuple[Any, ...]]:
    """``GPT2LMHeadModel`` of these sizes (vocabulary 2048, random weights) as a module returning
    the logits, and ``(token ids,)`` of ``batch`` x ``seq``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, n_positions=max(seq, 64), vocab_size=2048,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT2LMHeadModel(config).eval()

        def forward(self, idx: Any) -> Any:
            return self.model(input_ids=idx, use_cache=False, return_dict=False)[0]

    idx = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return Logits().eval(), (idx,)


#: Models from outside the zoo: name -> builder (optional installs).
EXTERNAL: dict[str, Callable[..., tuple[Any, tuple[Any, ...]]]] = {"hf-gpt2": hf_gpt2}


def build_model(name: str, size: str = "bench", *, seed: int = 0) -> tuple[Any, tuple[Any, ...]]:
    """A zoo model or one of :data:`EXTERNAL`, as ``(module, example inputs)``."""
    if name in EXTERNAL:
        return EXTERNAL[name](size, seed=seed)
    return models.build(name, size, seed=seed)


def measure_ort(
    model_name: str,
    size: str = "bench",
    devices: int = 2,
    repeats: int = 30,
    *,
    warmup: int = 5,
    device_map: Any = "auto",
    seed: int = 0,
    threads: int | None = None,
    plan: str = "half",
    explain: bool = False,
    block: int = 1,
    trials: int = 1,
) -> dict[str, Any]:
    """Time ``pl.Runner`` on the placed model against one session of the unplaced model.

    ``plan``: ``"half"`` (activations shifted in equal runs) or ``"auto"``
    (``pl.auto_place`` with its defaults). ``explain``: add ``explain``, the
    per-run overhead by cause in ms (module docstring). ``block``: alternate blocks of
    this many runs.

    ``trials``: build both contenders afresh this many times (new sessions, new
    input arrays) and time each pair (``repeats`` runs each). Where a session's
    arenas and weights land in memory shifts its speed by about 1% for the life
    of the session (the same single session built twice in one process differs
    that much, run for run alternated), which no number of repeats averages out;
    fresh pairs do. ``ratio`` is then the median of the per-pair ratios, the
    milliseconds the medians over all runs.

    Both use :func:`placement.runtime.ort.sessions.session_options` with ``threads``
    intra-op threads (None: ONNX Runtime's default).

    Returns:
        A dict with ``model``, ``size``, ``devices``, ``ops``, ``copies``,
        ``stages``, ``transfers`` (cross-device handovers per run), ``moved`` (those
        that copy data; none between emulated devices), ``blocked`` (boundaries kept in
        ONNX Runtime's blocked layout), ``device_map``, ``single_ms`` /
        ``placed_ms`` (medians), ``ratio`` (placed / single; with ``trials``, the
        median of ``ratio_trials``), ``ratio_min``
        (fastest run over fastest run, less sensitive to load) and
        ``max_abs_diff`` (placed vs single outputs).

    Example:
        >>> row = measure_ort("mlp", "tiny", repeats=3, warmup=1)
        >>> row["stages"], row["max_abs_diff"] < 1e-4
        (2, True)
    """
    net, args = build_model(model_name, size, seed=seed)
    model = pl.from_torch(net, args)
    placed = _place(model.copy(), devices, plan, args)
    proto = to_proto(model).SerializeToString()
    times: dict[str, list[float]] = {"single": [], "placed": []}
    ratios, diff = [], 0.0
    for _ in range(max(1, trials)):
        runner = pl.Runner(placed, device_map=device_map, threads=threads)
        physical = runner.device_map[min(runner.device_map)]
        single = ort.InferenceSession(
            proto, session_options(physical, threads=threads), providers=providers(physical)
        )
        feeds = {name: a.numpy().copy() for name, a in zip(model.inputs, args)}
        got = runner.run(feeds)
        want = single.run(None, feeds)
        diff = max(diff, *(float(np.max(np.abs(a - b))) for a, b in zip(got, want)))
        contenders = {
            "single": functools.partial(single.run, None, feeds),
            "placed": functools.partial(runner.run, feeds),
        }
        pair = alternate(contenders, repeats, warmup=warmup, block=block).wall
        ratios.append(statistics.median(pair["placed"]) / statistics.median(pair["single"]))
        for name, spent in pair.items():
            times[name] += spent
    single_ms = statistics.median(times["single"]) * 1e3
    placed_ms = statistics.median(times["placed"]) * 1e3
    row = {
        "model": model_name,
        "plan": plan,
        "size": size,
        "devices": devices,
        "ops": len(placed.ops),
        "copies": sum(op.is_copy for op in placed.ops),
        "stages": len(runner.stages),
        "transfers": runner.program.n_handovers,
        "moved": runner.stats.transfers,  # of those, the ones that copy data (emulated devices share)
        "blocked": list(runner.blocked_boundaries),
        "device_map": {str(k): str(v) for k, v in sorted(runner.device_map.items())},
        "emulated": any(p.emulated for p in runner.device_map.values()),
        "single_ms": round(single_ms, 4),
        "placed_ms": round(placed_ms, 4),
        "ratio": round(statistics.median(ratios), 4),
        "ratio_trials": [round(r, 4) for r in ratios],
        "ratio_min": round(min(times["placed"]) / min(times["single"]), 4),
        "max_abs_diff": diff,
        "repeats": repeats,
        "block": block,
        "trials": len(ratios),
        "threads": threads,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if explain:
        row["explain"] = explain_overhead(runner, single, feeds, repeats=repeats, warmup=warmup)
    return row


def _place(model: pl.Model, devices: int, plan: str, args: Sequence[Any]) -> pl.Model:
    if plan == "half":
        return pl.place_evenly(model, devices)
    if plan == "auto":
        pl.auto_place(model, devices=devices, sample_inputs=tuple(args))
        pl.inject_cross_device_copies(model)
        pl.verify(model)
        return model
    raise ValueError(f"unknown plan {plan!r}: 'half' or 'auto'")


def explain_overhead(
    runner: pl.Runner,
    single: ort.InferenceSession,
    feeds: dict[str, np.ndarray],
    *,
    repeats: int,
    warmup: int,
) -> dict[str, float]:
    """The placed run's overhead over the single session by cause, in ms (module docstring).

    Walks the runner's compiled program as ``Runner.run`` does (its native run where it
    has one, else its steps) with a timer around each kind of work, alternating with
    the single session.
    """
    from onnxruntime.capi import _pybind_state as _C

    from placement.runtime.inputs import normalize_inputs
    from placement.runtime.ort.program import NativeRun
    from placement.runtime.ort.steps import StageStep
    from placement.runtime.ort.values import _CPU, _owned

    program = runner.program
    assert program is not None
    arrays = list(feeds.values())
    parts = ("checks", "binding", "stages", "transfers", "outputs")

    def instrumented() -> dict[str, float]:
        spent = dict.fromkeys(parts, 0.0)
        clock = time.perf_counter
        t0 = clock()
        runner.update()
        normalize_inputs(feeds, runner._specs)
        t1 = clock()
        spent["checks"] += t1 - t0
        if program.native is not None:
            return native_parts(program.native, spent)
        values: dict[str, Any] = program.feed(arrays)
        for step in program.steps:
            if isinstance(step, StageStep):
                t0 = clock()
                stage_feeds = step.inputs(values)
                t1 = clock()
                outputs = step.call(stage_feeds)
                t2 = clock()
                step.store(values, outputs)
                t3 = clock()
                spent["binding"] += (t1 - t0) + (t3 - t2)
                spent["stages"] += t2 - t1
            else:  # transfers (host-value stages do not occur in these models)
                t0 = clock()
                step.run(values)
                spent["transfers"] += clock() - t0
        t0 = clock()
        program.collect(values)
        spent["outputs"] += clock() - t0
        return spent

    def native_parts(native: NativeRun, spent: dict[str, float]) -> dict[str, float]:
        """:meth:`NativeRun.run` with the same timers (its aliases cost nothing per run)."""
        clock = time.perf_counter
        t0 = clock()
        values: dict[str, Any] = {
            key: _C.OrtValue.ortvalue_from_numpy(array, _CPU) for key, array in zip(native.feeds, arrays)
        }
        spent["binding"] += clock() - t0
        for ex, bind, outputs, free in native.stages:
            t0 = clock()
            stage_feeds = {name: values[key] for name, key in bind}
            t1 = clock()
            results = ex.direct(stage_feeds, outputs, None)
            t2 = clock()
            for i, name in enumerate(outputs):
                values[name] = results[i]
            for key in free:
                del values[key]
            t3 = clock()
            spent["binding"] += (t1 - t0) + (t3 - t2)
            spent["stages"] += t2 - t1
        t0 = clock()
        for key, const in native.outputs:
            _owned(values[key], values[key].numpy()) if const is None else const.copy()
        spent["outputs"] += clock() - t0
        return spent

    for _ in range(warmup):
        instrumented()
        single.run(None, feeds)
    samples: dict[str, list[float]] = {k: [] for k in (*parts, "single", "placed")}
    for i in range(repeats):
        order = ("single", "placed", "parts") if i % 2 == 0 else ("parts", "placed", "single")
        for what in order:
            if what == "parts":
                for k, v in instrumented().items():
                    samples[k].append(v)
            else:
                start = time.perf_counter()
                single.run(None, feeds) if what == "single" else runner.run(feeds)
                samples[what].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    result = {
        "cut": med["stages"] - med["single"],
        "transfers": med["transfers"],
        "binding": med["binding"],
        "checks": med["checks"],
        "outputs": med["outputs"],
    }
    result["other"] = med["placed"] - med["single"] - sum(result.values())
    result["total"] = med["placed"] - med["single"]
    result["single_ms"] = med["single"]
    return {k: round(v, 4) for k, v in result.items()}


def _torch_measure() -> Callable[..., dict[str, Any]] | None:
    try:
        from benchmarks.torch_lowering import measure
    except Exception as err:  # the torch-lowering benchmark is optional here
        log.warning("benchmarks/torch_lowering.py unavailable (%s); torch columns left empty", err)
        return None
    return measure


def _table(rows: Sequence[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(
        title=(
            f"placement runtimes: placed ORT / single ORT session (target <= {ORT_TARGET:.2f}), "
            f"lowered torch / eager torch (target <= {TORCH_TARGET:.2f}); medians"
        )
    )
    columns = [
        "model",
        "plan",
        "size",
        "dev",
        "stages",
        "transfers",
        "ORT single ms",
        "ORT placed ms",
        "ORT ratio",
        "ORT per pair",
        "torch eager ms",
        "torch lowered ms",
        "torch ratio",
        "physical",
    ]
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "size", "physical") else "right")

    def ratio(value: float | None, target: float) -> str:
        if value is None:
            return "-"
        return f"[{'green' if value <= target else 'red'}]{value:.3f}[/]"

    for row in rows:
        t = row.get("torch") or {}
        physical = sorted(set(row["device_map"].values()))
        table.add_row(
            row["model"],
            row.get("plan", "half"),
            row["size"],
            str(row["devices"]),
            str(row["stages"]),
            str(row["transfers"]),
            f"{row['single_ms']:.2f}",
            f"{row['placed_ms']:.2f}",
            ratio(row["ratio"], ORT_TARGET),
            " ".join(f"{r:.3f}" for r in row.get("ratio_trials", [])),
            f"{t['eager_ms']:.2f}" if t else "-",
            f"{t['lowered_ms']:.2f}" if t else "-",
            ratio(t.get("ratio"), TORCH_TARGET),
            ",".join(physical) + (" (emulated)" if row["emulated"] else ""),
        )
    return table


def _explain_table(rows: Sequence[dict[str, Any]]) -> Any:
    from rich.table import Table

    causes = ["cut", "transfers", "binding", "checks", "outputs", "other", "total"]
    table = Table(title="placed ORT run: overhead over the single session by cause (ms, % of single)")
    for column in ["model", "plan", "dev", *causes]:
        table.add_column(column, justify="left" if column in ("model", "plan") else "right")
    for row in rows:
        ex = row.get("explain")
        if not ex:
            continue
        single = ex["single_ms"] or 1.0
        table.add_row(
            row["model"],
            row.get("plan", "half"),
            str(row["devices"]),
            *(f"{ex[c]:+.3f} ({100 * ex[c] / single:+.1f}%)" for c in causes),
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print a table and write the JSON results."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["gpt", "resnet"], help=f"zoo models or {', '.join(EXTERNAL)}"
    )
    parser.add_argument("--size", default="bench", choices=list(models.SIZES))
    parser.add_argument("--devices", nargs="+", type=int, default=[2])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device-map", default="auto", help="'auto', 'cpu' or 'cuda:0'")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch lowering columns")
    parser.add_argument(
        "--plans",
        nargs="+",
        default=["half", "auto"],
        choices=["half", "auto"],
        help="half: activations shifted in equal runs; auto: pl.auto_place's default plan",
    )
    parser.add_argument("--explain", action="store_true", help="per-run overhead by cause")
    parser.add_argument("--block", type=int, default=1, help="alternate blocks of this many runs")
    parser.add_argument(
        "--trials",
        type=int,
        default=5,
        help="fresh (single session, runner) pairs per row; the ratio is the median of theirs",
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs of each first")
    parser.add_argument(
        "--threads", type=int, default=None, help="ORT intra-op threads per session (default: ORT's choice)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 170)
    torch_measure = None if ns.no_torch else _torch_measure()
    rows = []
    for name in ns.models:
        for n in ns.devices:
            for plan in ns.plans:
                with console.status(f"{name} ({ns.size}) on {n} devices, {plan} plan: ONNX Runtime..."):
                    row = measure_ort(
                        name,
                        ns.size,
                        n,
                        ns.repeats,
                        device_map=ns.device_map,
                        threads=ns.threads,
                        plan=plan,
                        explain=ns.explain,
                        block=ns.block,
                        warmup=ns.warmup,
                        trials=ns.trials,
                    )
                if torch_measure is not None and plan == "half" and name not in EXTERNAL:
                    with console.status(f"{name} ({ns.size}) on {n} devices: torch..."):
                        row["torch"] = torch_measure(name, ns.size, n, ns.repeats, device_map=ns.device_map)
                rows.append(row)
    env = environment(threads=ns.threads)
    print_tables(_table(rows), *([_explain_table(rows)] if ns.explain else []), env=env, width=console.width)
    payload = {
        "benchmark": "runtime",
        "targets": {"ort_placed_over_single": ORT_TARGET, "torch_lowered_over_eager": TORCH_TARGET},
        "environment": env,
        "results": rows,
    }
    write_results(ns.output, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
