"""Benchmark: pipelined execution over micro-batches, both runtimes, side by side in one run.

Bench-size ``gpt`` and ``resnet`` are exported with a dynamic batch and placed on
two logical devices, once per runtime: the ONNX Runtime rows run the plan of
``calibrate(model, devices=2)`` (:mod:`placement.runtime.calibrate`:
``auto_place(runtime="ort")``, optimised-session op times and no cut inside a fused
group, then re-planned on the measured times of its 1-thread stage sessions;
``--no-calibrate``: the ``auto_place(runtime="ort")`` plan alone), the torch rows the
plans of ``calibrate(model, devices=2, runtime="torch")`` (``auto_place(runtime="torch")``,
ops timed one by one, then re-planned on the measured times of the lowered stages: their
forward for the forward rows, forward and backward with ``training=True`` for the training
rows; ``--no-calibrate``: ``auto_place`` alone). On CPU every logical device
is emulated with its own session / worker thread, so two stages can use two
cores at once. A mini-batch is 8 of the model's example batches (GPT: 16
sequences of 128 tokens; ResNet: 64 images of 64x64), so ``chunks=8`` gives
micro-batches of the example size; the stream serves example batches, 32 of them
(``--stream-length``: a serving stream is long, so fill and drain are a small share).
Every contender gets one intra-op thread per stage (the baseline one thread in
all), and throughput is compared:

* **ONNX Runtime**: one ``InferenceSession`` of the unplaced model vs
  ``Runner(chunks=8).run`` on the same mini-batch, and vs ``Runner.stream``
  over a stream of small batches (the single session runs them one by one).
  Targets: stream >= 1.7 (limit 2 in steady state; 2 x 32/33 = 1.94 for a stream of
  32 on 2 stages), run(chunks=8) >= 1.55 (limit 2 x 8/9 = 1.78, the GPipe bubble).
* **torch**: the eager module vs ``pl.to_torch(model, chunks=8)``: forward
  (no grad) >= 1.6, and a training step (forward + backward of a squared-output
  loss, ``checkpoint="never"``) >= 1.5, the step taken with
  ``module.train_step(x, loss_fn=loss)`` (the loss per micro-batch: 1F1B with deferred
  weight gradients, :mod:`placement.runtime.torch.one_f_one_b`); the same step as
  ``loss(module(x)).backward()`` (GPipe: the loss waits for the whole forward) is
  timed beside it. Both give the eager step's gradients. torchgpipe's ``GPipe`` on the same
  model as an ``nn.Sequential`` (balance taken from our torch plan, devices
  ``["cpu", "cpu"]``, same chunks) in the same table, when installed
  (``pip install torchgpipe``; a benchmark-only dependency).
* **chunks sweep**: ``Runner.run`` with chunks 1, 2, 4, 8, 16: speedup over the
  single session, and the idle share ``1 - T(chunks=1) / (N * T(chunks=k))``
  next to GPipe's bubble ``(N-1)/(k+N-1)`` (N = 2 stages).

The allocator: torch allocates every activation and gradient with ``malloc``.
Under glibc's malloc a training step of the pipelined module page-faults tens
of thousands of times (below) and does 1.12-1.19x the eager step's CPU work; with
tcmalloc (``libtcmalloc-minimal4``) both the eager baseline and the pipeline run
faster and the pipeline's extra work falls to about 1.05-1.09x (bench gpt:
train ratio 1.46 -> 1.59 in one pair of runs). ``--allocator auto`` (the
default) re-executes the benchmark with tcmalloc, else jemalloc, preloaded
(``LD_PRELOAD``) when one is installed, so every contender, baselines included,
runs on it; ``--allocator glibc`` keeps glibc. The allocator is recorded in the
results. It is the usual advice for torch on CPU (PyTorch's performance tuning
guide); the library itself does not change a process's allocator.

Training on CPU under glibc: each pipeline worker thread gets its own glibc malloc arena,
and glibc unmaps an arena's heaps once they are free, so every training step
page-faults its activations and gradients in again (tens of thousands of
faults, ~5-9% of the step's CPU time on bench gpt; the single-threaded eager
baseline allocates from the main arena and does not). ``--malloc-arena-max 1``
(glibc's ``mallopt(M_ARENA_MAX, 1)`` before any thread starts, the same as
``MALLOC_ARENA_MAX=1``) puts every thread on the main arena; a caching
allocator (jemalloc, tcmalloc via ``LD_PRELOAD``) does the same job. Off by
default; the setting is recorded in the results.

Contenders alternate call by call (the order flips every round) so load from
other processes hits all of them; the table shows medians. The torch rows are
timed ``--trials`` times (default 3), each trial with freshly built modules, and
report the median of the per-trial ratios with every trial's ratio beside it: two
busy cores make the pipelined contenders' speed move more from trial to trial
than the one-thread eager baseline's. Results are written
to ``benchmarks/results/pipeline.json``.

Usage::

    python benchmarks/pipeline.py --quick        # a few repeats, chunks sweep on gpt only
    python benchmarks/pipeline.py                # full: both models, more repeats
    python benchmarks/pipeline.py --fixed-cost   # the schedule's fixed cost per micro-batch per stage
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

import placement as pl  # noqa: E402
from benchmarks.allocator import choose as choose_allocator  # noqa: E402
from benchmarks.allocator import malloc_arena_max  # noqa: E402
from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import alternate, environment, environment_line, write_results  # noqa: E402
from benchmarks.pipeline_gpipe import torchgpipe  # noqa: E402
from placement.graph.saving import to_proto  # noqa: E402
from placement.models import gpt, resnet  # noqa: E402
from placement.runtime.calibrate import calibrate  # noqa: E402
from placement.runtime.device_map import PhysicalDevice  # noqa: E402
from placement.runtime.ort.sessions import session_options  # noqa: E402
from placement.runtime.schedule import bubble_fraction  # noqa: E402

log = logging.getLogger("benchmarks.pipeline")

RESULTS = RESULTS_DIR / "pipeline.json"
#: Batches per timed stream: a serving stream is long, so its fill and drain (one batch time
#: per extra stage) are a small share: 32 batches on 2 stages bound the ratio at 2 x 32/33 = 1.94.
STREAM_LENGTH = 32
TARGETS = {"ort_stream": 1.7, "ort_run_chunks8": 1.55, "torch_forward": 1.6, "torch_train": 1.5}
CHUNKS = 8  # micro-batches per mini-batch; a micro-batch is the model's bench example batch
#: torch rows: fresh (lowered, pipelined, torchgpipe) modules per trial; ratios are per-trial medians.
TRIALS = 3


def _build(name: str) -> tuple[torch.nn.Module, torch.Tensor, int]:
    """The bench model, a mini-batch of ``CHUNKS`` example batches, and the example batch size."""
    module = {"gpt": gpt, "resnet": resnet}[name]
    net, (x,) = module.build("bench")
    return net.eval(), torch.cat([x] * CHUNKS).contiguous(), int(x.shape[0])


def _calibration_info(result: Any) -> dict[str, Any]:
    return {
        "trials": [
            {"predicted_ms": [s * 1e3 for s in t.predicted_s], "measured_ms": [s * 1e3 for s in t.measured_s]}
            for t in result.trials
        ],
        "chosen": result.chosen,
    }


def _place(
    net: torch.nn.Module, x: torch.Tensor, sample: int, *, calibrated: bool = True
) -> tuple[pl.Model, pl.Model, dict[str, pl.Model], dict[str, Any]]:
    """The unplaced model, its ORT placement, its torch placements for forward and for a
    training step (copies injected), plan facts."""
    batch = torch.export.Dim("batch")
    unplaced = pl.from_torch(net, (x,), dynamic_shapes=({0: batch},))
    ort_model = unplaced.copy()
    torch_models = {"forward": unplaced.copy(), "train": unplaced.copy()}
    example = [x[:sample]]
    info: dict[str, Any] = {"calibration": {}}
    options: dict[str, Any] = dict(sample_inputs=example, profile_repeats=3, device_map="cpu")
    plans = {}
    if calibrated:
        result = calibrate(ort_model, devices=2, **options)
        info["calibration"]["ort"] = _calibration_info(result)
        plans["ort"] = result.plan
        for kind, model in torch_models.items():
            result = calibrate(model, devices=2, runtime="torch", training=kind == "train", **options)
            info["calibration"][f"torch_{kind}"] = _calibration_info(result)
            plans[f"torch_{kind}"] = result.plan
    else:
        plans["ort"] = pl.auto_place(ort_model, devices=2, sample_inputs=example, repeats=3, runtime="ort")
        for kind, model in torch_models.items():
            plans[f"torch_{kind}"] = pl.auto_place(
                model, devices=2, sample_inputs=example, repeats=3, runtime="torch"
            )
    for key, plan in plans.items():
        info[f"{key}_plan_ms"] = [d.stage_cost / 1e6 for d in plan.devices]
        info[f"{key}_last_op_on_first"] = plan.devices[0].last_op
    for model in (ort_model, *torch_models.values()):
        pl.inject_cross_device_copies(model)
    return unplaced, ort_model, torch_models, info


# --- measurements ----------------------------------------------------------------------------


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _torch_rows(
    name: str,
    net: torch.nn.Module,
    x: torch.Tensor,
    models: dict[str, pl.Model],
    *,
    chunks: int,
    repeats: int,
    trials: int,
) -> dict[str, Any]:
    """torch: eager vs the plain and pipelined lowerings vs torchgpipe, forward and a training
    step, ``trials`` times with fresh modules; ratios are medians of the per-trial ratios."""

    def fwd(module: Any) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return module(x)

        return call

    def step(module: Any) -> Callable[[], Any]:
        def call() -> None:
            module.zero_grad(set_to_none=True)
            _loss(module(x)).backward()

        return call

    def _train_step(module: Any) -> Callable[[], Any]:
        def call() -> None:
            module.zero_grad(set_to_none=True)
            module.train_step(x, loss_fn=_loss)

        return call

    runs: dict[str, list[dict[str, Any]]] = {"forward": [], "train": []}
    balance = None
    for _ in range(trials):
        for kind, wrap, reps in (("forward", fwd, repeats), ("train", step, max(3, repeats // 2))):
            model = models[kind]
            lowered = pl.to_torch(model, device_map="cpu")
            pmod = pl.to_torch(model, device_map="cpu", chunks=chunks, checkpoint="never")
            if kind == "forward" and not runs["forward"]:
                with torch.no_grad():
                    torch.testing.assert_close(pmod(x), net(x), atol=1e-3, rtol=1e-3)
            fns = {"eager": wrap(net), "lowered": wrap(lowered), "pipelined": wrap(pmod)}
            if kind == "train":
                fns["train_step"] = _train_step(pmod)
            gp = torchgpipe(name, net, models["forward"], chunks)
            if gp is not None:
                fns["torchgpipe"], balance = wrap(gp[0]), gp[1]
            timings = alternate(fns, reps)
            runs[kind].append({"s": timings.medians(), "cpu_s": timings.cpu_medians()})
            del lowered, pmod, gp
    result: dict[str, Any] = {"trials": trials, "torchgpipe_balance": balance}
    for kind in ("forward", "train"):
        per_trial = [{k: r["s"]["eager"] / v for k, v in r["s"].items()} for r in runs[kind]]
        names = list(per_trial[0])
        result[f"{kind}_ratio"] = {k: statistics.median(t[k] for t in per_trial) for k in names}
        result[f"{kind}_ratio_trials"] = {k: [t[k] for t in per_trial] for k in names}
        result[f"{kind}_s"] = {k: statistics.median(r["s"][k] for r in runs[kind]) for k in names}
        result[f"{kind}_parallelism"] = {
            k: statistics.median(r["cpu_s"][k] / r["s"][k] for r in runs[kind]) for k in names
        }
        result[f"{kind}_work"] = {
            k: statistics.median(r["cpu_s"][k] / r["cpu_s"]["eager"] for r in runs[kind]) for k in names
        }
    return result


def measure(
    name: str,
    *,
    repeats: int,
    sweep: bool,
    chunks: int = CHUNKS,
    calibrated: bool = True,
    stream_length: int = STREAM_LENGTH,
    trials: int = TRIALS,
) -> dict[str, Any]:
    torch.manual_seed(0)
    net, x, sample = _build(name)
    unplaced, model, torch_models, plan_info = _place(net, x, sample, calibrated=calibrated)
    xs = x.numpy()
    cpu = PhysicalDevice("cpu")
    single = ort.InferenceSession(
        to_proto(unplaced).SerializeToString(),
        session_options(cpu, threads=1),
        providers=["CPUExecutionProvider"],
    )
    feed_name = single.get_inputs()[0].name
    piped = pl.Runner(model, device_map="cpu", chunks=chunks, threads_per_stage=1)
    streamer = pl.Runner(model, device_map="cpu", threads_per_stage=1)
    # a serving stream: the mini-batch's example batches, over and over (steady state)
    examples = [xs[i : i + sample] for i in range(0, len(xs), sample)]
    stream_batches = [examples[i % len(examples)] for i in range(stream_length)]
    n_stages = len(piped.stages)

    ref = single.run(None, {feed_name: xs})[0]
    np.testing.assert_allclose(piped.run([xs])[0], ref, atol=1e-3, rtol=1e-3)

    def single_stream() -> None:
        for b in stream_batches:
            single.run(None, {feed_name: b})

    ort_timings = alternate(
        {
            "single": lambda: single.run(None, {feed_name: xs}),
            "run": lambda: piped.run([xs]),
            "single_stream": single_stream,
            "stream": lambda: list(streamer.stream(stream_batches)),
        },
        repeats,
    )
    ort_times, ort_cpu = ort_timings.medians(), ort_timings.cpu_medians()
    rows: dict[str, Any] = {
        "model": name,
        "batch": len(xs),
        "stream_batch": sample,
        "stream_length": stream_length,
        "chunks": chunks,
        "stages": n_stages,
        "plan_devices": [str(d) for d in model.devices],
        "plans": plan_info,
        "ort": {
            "single_s": ort_times["single"],
            "run_s": ort_times["run"],
            "run_ratio": ort_times["single"] / ort_times["run"],
            "stream_single_s": ort_times["single_stream"],
            "stream_s": ort_times["stream"],
            "stream_ratio": ort_times["single_stream"] / ort_times["stream"],
            "cpu_s": ort_cpu,
            "work": {
                "run": ort_cpu["run"] / ort_cpu["single"],
                "stream": ort_cpu["stream"] / ort_cpu["single_stream"],
            },
            "parallelism": {k: ort_cpu[k] / ort_times[k] for k in ort_times},
        },
    }

    rows["torch"] = _torch_rows(name, net, x, torch_models, chunks=chunks, repeats=repeats, trials=trials)

    if sweep:
        runners = {
            k: pl.Runner(model, device_map="cpu", chunks=k, threads_per_stage=1) for k in (1, 2, 4, 8, 16)
        }
        fns: dict[str, Callable[[], Any]] = {"single": lambda: single.run(None, {feed_name: xs})}
        for k, r in runners.items():
            fns[f"chunks{k}"] = functools.partial(r.run, [xs])
        times = alternate(fns, repeats).medians()
        t1 = times["chunks1"]
        rows["sweep"] = [
            {
                "chunks": k,
                "speedup": times["single"] / times[f"chunks{k}"],
                "idle": 1 - t1 / (n_stages * times[f"chunks{k}"]),
                "gpipe_bubble": bubble_fraction(k, n_stages),
            }
            for k in runners
        ]
    return rows


def _print(results: list[dict[str, Any]], env: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    console.print(environment_line(env), highlight=False)
    table = Table(
        title="pipelined / baseline throughput (2 logical devices, 1 thread per stage); "
        "CPU work / baseline: process CPU seconds per mini-batch over the baseline's "
        "(load-independent; the speed-up on 2 free cores is at most 2 / work)"
    )
    for col in (
        "model",
        "runtime",
        "contender",
        "ratio",
        "target",
        "cores used (cpu/wall)",
        "CPU work / baseline",
    ):
        table.add_column(col)
    for res in results:
        o = res["ort"]
        par = o["parallelism"]
        table.add_row(
            res["model"],
            "ORT",
            "run(chunks=8) / one session",
            f"{o['run_ratio']:.2f}",
            ">= 1.55",
            f"{par['run']:.2f} vs {par['single']:.2f}",
            f"{o['work']['run']:.2f}",
        )
        table.add_row(
            res["model"],
            "ORT",
            "stream / one session",
            f"{o['stream_ratio']:.2f}",
            ">= 1.7",
            f"{par['stream']:.2f} vs {par['single_stream']:.2f}",
            f"{o['work']['stream']:.2f}",
        )
        t = res["torch"]
        for kind, key, target in (
            ("forward", "forward_ratio", ">= 1.6"),
            ("train step", "train_ratio", ">= 1.5"),
        ):
            for contender in ("lowered", "pipelined", "train_step", "torchgpipe"):
                if contender in t[key]:
                    label = {
                        "lowered": "to_torch (no pipelining)",
                        "pipelined": "to_torch(chunks=8)" + ("" if kind == "forward" else " backward()"),
                        "train_step": "to_torch(chunks=8).train_step",
                        "torchgpipe": f"torchgpipe GPipe{t['torchgpipe_balance']}",
                    }[contender]
                    prefix = "forward" if kind == "forward" else "train"
                    par = t[f"{prefix}_parallelism"]
                    work = t[f"{prefix}_work"][contender]
                    each = " ".join(f"{v:.2f}" for v in t[f"{prefix}_ratio_trials"][contender])
                    table.add_row(
                        res["model"],
                        "torch",
                        f"{kind}: {label} / eager",
                        f"{t[key][contender]:.2f} ({each})",
                        target if contender == ("pipelined" if kind == "forward" else "train_step") else "",
                        f"{par[contender]:.2f} vs {par['eager']:.2f}",
                        f"{work:.2f}",
                    )
    console.print(table)
    for res in results:
        for what, calibration in res["plans"]["calibration"].items():
            for k, trial in enumerate(calibration["trials"]):
                mark = "chosen" if k == calibration["chosen"] else ""
                pred = " | ".join(f"{t:.2f}" for t in trial["predicted_ms"])
                meas = " | ".join(f"{t:.2f}" for t in trial["measured_ms"])
                console.print(
                    f"{res['model']} {what} calibration trial {k}: predicted {pred} ms, "
                    f"stages measured {meas} ms {mark}"
                )
    for res in results:
        if "sweep" not in res:
            continue
        sweep = Table(title=f"{res['model']}: ORT Runner.run throughput vs chunks ({res['stages']} stages)")
        for col in (
            "chunks",
            "speedup vs one session",
            "idle share (measured)",
            "GPipe bubble (N-1)/(k+N-1)",
        ):
            sweep.add_column(col)
        for row in res["sweep"]:
            sweep.add_row(
                str(row["chunks"]),
                f"{row['speedup']:.2f}",
                f"{row['idle']:.2f}",
                f"{row['gpipe_bubble']:.2f}",
            )
        console.print(sweep)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    if "--fixed-cost" in args_in:  # the schedule's fixed cost: benchmarks/pipeline_fixed_cost.py
        from benchmarks import pipeline_fixed_cost

        return pipeline_fixed_cost.main([a for a in args_in if a != "--fixed-cost"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats; chunks sweep on gpt only")
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"], choices=["gpt", "resnet"])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--stream-length",
        type=int,
        default=STREAM_LENGTH,
        help=f"example batches per timed stream (default {STREAM_LENGTH}: steady state, as in serving)",
    )
    parser.add_argument(
        "--malloc-arena-max",
        type=int,
        default=None,
        metavar="N",
        help="glibc mallopt(M_ARENA_MAX, N) before any thread starts (see the module docstring)",
    )
    parser.add_argument(
        "--allocator",
        default="auto",
        choices=["auto", "tcmalloc", "jemalloc", "glibc"],
        help="malloc for the whole process, every contender alike (default auto: tcmalloc, else "
        "jemalloc, else glibc; see the module docstring)",
    )
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="plans from auto_place alone (runtime 'ort' and 'torch'), not calibrated on measured stages",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help=f"torch rows: fresh modules timed this many times, median ratio (default {TRIALS}; --quick 1)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    allocator = choose_allocator(args.allocator, Path(__file__), sys.argv[1:] if argv is None else list(argv))
    if args.malloc_arena_max is not None and not malloc_arena_max(args.malloc_arena_max):
        log.warning("mallopt(M_ARENA_MAX) is not available (not glibc?): --malloc-arena-max ignored")
        args.malloc_arena_max = None
    torch.set_num_threads(1)
    repeats = args.repeats or (5 if args.quick else 15)
    results = []
    env = environment(
        torch_threads=torch.get_num_threads(), malloc_arena_max=args.malloc_arena_max, allocator=allocator
    )
    for name in args.models:
        sweep = not args.quick or name == args.models[0]
        results.append(
            measure(
                name,
                repeats=repeats,
                sweep=sweep,
                calibrated=not args.no_calibrate,
                stream_length=args.stream_length,
                trials=args.trials or (1 if args.quick else TRIALS),
            )
        )
    _print(results, env)
    payload = {
        "environment": env,
        "repeats": repeats,
        "quick": args.quick,
        "targets": TARGETS,
        "results": results,
    }
    write_results(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
