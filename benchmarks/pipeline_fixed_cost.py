"""Benchmark: the pipeline schedule's fixed cost per micro-batch per stage (``pipeline.py --fixed-cost``).

Near-zero compute: ``max(4, N)`` ``Linear(8, 8)`` layers (a batch of 64 rows) placed in
``N`` = 2, 4 and 8 equal stages, one intra-op thread per stage (``torch.set_num_threads(1)``;
``Runner(threads_per_stage=1)``). Every contender runs the batch as 16 micro-batches of 4
rows against the same batch unsplit, the two alternating in blocks of calls (the order
flipping every round) after a warm-up that reaches steady state (traced stages included),
and the fixed cost is what the schedule adds for each of the 16 micro-batches, per stage,
counted as if the stages' calls ran one after another (their Python holds one lock, the GIL)::

    fixed = (T(16 micro-batches) - T(unsplit)) / (16 * N)

(``per_mb_us`` beside it is the same without dividing by ``N``: what each micro-batch
adds to the step; ``fixed_cpu_us`` the same in process CPU time, all threads, which a
loaded machine inflates less than the wall time: a thread hand-off waits for a core.)
``pl.predict`` takes it as ``fixed_cost_s``. For the ORT contenders ``waits_per_mb_stage``
(column ``waits``) counts the schedule's blocking queue waits per micro-batch per stage in the
16-micro-batch calls: each is a thread hand-off, which waits for a core. Contenders:

* ``ort run``: ``Runner(chunks=16).run`` against ``Runner().run``;
* ``ort stream``: ``Runner.stream`` over the 16 micro-batches against ``Runner().run`` of
  the whole batch;
* ``torch 1f1b`` (``pl.train_step`` on ``to_torch(chunks=16)``) and ``torch gpipe``
  (``loss(module(x)).backward()`` on it), each with ``checkpoint="never"`` and
  ``"except_last"`` (every stage but the last recomputes its forward during the backward:
  the row says ``recompute``), against the same step on ``to_torch()`` (one stage after
  another, no micro-batches). These run with ``executor="auto"`` (tiny stages: every stage
  on the caller's thread); the rows marked ``executor=threads`` run the same steps with a
  thread per stage. ``torch eager loop (floor)`` runs the 16 micro-batches' forward, loss
  and backward one after another on ``to_torch()`` without any schedule: what torch itself
  pays per micro-batch, a floor for the torch rows that a loaded machine inflates alike.

``--crossover`` measures instead where a thread per stage starts to pay for a 1F1B step on
the CPU: two stages of two ``Linear(d, d)`` layers each, a batch of 256 in 16 micro-batches,
for widths ``d`` from 64 to 1024, ``executor="inline"`` against ``"threads"`` (alternating
blocks; re-run under tcmalloc where installed, as ``benchmarks/pipeline.py`` runs), with the
multiply-adds per micro-batch per stage that ``executor="auto"`` compares with
``placement.runtime.torch.executor.THREADS_MIN_MACS`` and its choice.
Writes ``benchmarks/results/pipeline_fixed_cost_crossover.json``.

Usage::

    python benchmarks/pipeline.py --fixed-cost              # CPU, and the GPU when there is one
    python benchmarks/pipeline_fixed_cost.py --stages 2 --repeats 10 --device cpu
    python benchmarks/pipeline_fixed_cost.py --crossover --repeats 10
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import queue
import statistics
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

import placement as pl  # noqa: E402
from benchmarks.allocator import choose as choose_allocator  # noqa: E402
from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import alternate, environment, print_tables, write_results  # noqa: E402

__all__ = ["main", "measure", "ort_waits", "runner_options", "tiny_linear"]

RESULTS = RESULTS_DIR / "pipeline_fixed_cost.json"
CHUNKS = 16
BATCH = 64


def tiny_linear(stages: int) -> tuple[pl.Model, torch.Tensor]:
    """``max(4, stages)`` ``Linear(8, 8)`` layers, a dynamic batch of 64, placed in ``stages`` parts."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(max(4, stages))])
    x = torch.randn(BATCH, 8, generator=generator)
    model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    return pl.place_evenly(model, stages), x


def runner_options(device_map: Any) -> dict[str, Any]:
    """``device_map`` and, where ``pl.Runner`` accepts it, ``fold=False`` (stages sharing a
    device kept apart as sessions of their own)."""
    options: dict[str, Any] = {"device_map": device_map}
    if "fold" in inspect.signature(pl.Runner).parameters:
        options["fold"] = False
    return options


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _ort_contenders(model: pl.Model, x: torch.Tensor, device_map: Any) -> dict[str, dict[str, Callable]]:
    feeds = [x.numpy()]
    whole = pl.Runner(model, threads=1, **runner_options(device_map))
    piped = pl.Runner(model, chunks=CHUNKS, threads_per_stage=1, **runner_options(device_map))
    streamer = pl.Runner(model, threads_per_stage=1, **runner_options(device_map))
    micro = [[m.numpy()] for m in x.chunk(CHUNKS)]

    def stream() -> None:
        for _ in streamer.stream(micro):
            pass

    return {
        "ort run": {"k1": functools.partial(whole.run, feeds), "k16": functools.partial(piped.run, feeds)},
        "ort stream": {"k1": functools.partial(whole.run, feeds), "k16": stream},
    }


class _CountingQueue(queue.SimpleQueue):
    """A ``SimpleQueue`` that counts the ``get`` s that find it empty: a thread that waits (a hand-off)."""

    waits = 0

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self.empty():
            _CountingQueue.waits += 1
        return super().get(block, timeout)


def ort_waits(fn: Callable[[], Any], stages: int, calls: int = 5) -> float:
    """Blocking waits of the schedule's threads per micro-batch per stage in ``fn`` (an ORT
    contender's 16-micro-batch call): its queues counted while ``fn`` runs ``calls`` times."""
    from placement.runtime.schedule import workers

    original = workers.queue
    workers.queue = types.SimpleNamespace(SimpleQueue=_CountingQueue)  # type: ignore[assignment]
    try:
        _CountingQueue.waits = 0
        for _ in range(calls):
            fn()
        return _CountingQueue.waits / calls / CHUNKS / stages
    finally:
        workers.queue = original


def _torch_contenders(model: pl.Model, x: torch.Tensor, device_map: Any) -> dict[str, dict[str, Callable]]:
    x = x.to("cuda:0") if device_map != "cpu" else x
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    plain = pl.to_torch(model, device_map=device_map)

    def one_f_one_b(module: Any) -> None:
        pl.train_step(module, x, loss_fn=_loss)
        module.zero_grad(set_to_none=True)
        sync()

    def gpipe(module: Any) -> None:
        _loss(module(x)).backward()
        module.zero_grad(set_to_none=True)
        sync()

    def eager_loop(module: Any) -> None:  # what torch itself pays per micro-batch: no schedule
        for part in x.chunk(CHUNKS):
            (_loss(module(part)) / CHUNKS).backward()
        module.zero_grad(set_to_none=True)
        sync()

    rows = {"torch eager loop (floor)": {"k1": functools.partial(one_f_one_b, plain),
                                         "k16": functools.partial(eager_loop, plain)}}  # fmt: skip
    for checkpoint, executor in (("never", "auto"), ("never", "threads"), ("except_last", "auto")):
        piped = pl.to_torch(
            model, device_map=device_map, chunks=CHUNKS, checkpoint=checkpoint, executor=executor
        )
        suffix = "" if executor == "auto" else f" executor={executor}"
        for name, step in (("1f1b", one_f_one_b), ("gpipe", gpipe)):
            rows[f"torch {name} checkpoint={checkpoint}{suffix}"] = {
                "k1": functools.partial(step, plain),
                "k16": functools.partial(step, piped),
            }
    return rows


def crossover(
    widths: Sequence[int] = (64, 128, 256, 512, 1024), *, repeats: int = 10
) -> list[dict[str, Any]]:
    """Per width: a 1F1B step's milliseconds with ``executor="inline"`` and ``"threads"`` (two
    stages of two ``Linear(d, d)``, a batch of 256 in 16 micro-batches; see the module docstring)."""
    from placement.runtime.torch.executor import THREADS_MIN_MACS, stage_executor

    rows = []
    for width in widths:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
        x = torch.randn(256, width)
        model = pl.place_evenly(pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)), 2)
        modules = {
            ex: pl.to_torch(model, device_map="cpu", chunks=CHUNKS, executor=ex)
            for ex in ("inline", "threads")
        }

        def step(module: Any, x: torch.Tensor = x) -> None:
            pl.train_step(module, x, loss_fn=_loss)
            module.zero_grad(set_to_none=True)

        times = alternate(
            {ex: functools.partial(step, m) for ex, m in modules.items()}, repeats, warmup=3, block=2
        ).medians()
        inline, threads = times["inline"], times["threads"]
        stages = modules["inline"]._pl_stages
        macs = max(sum(v.numel() for v in s.consts.values()) for s in stages) * (256 // CHUNKS)
        rows.append({
            "width": width,
            "macs_per_mb_stage": macs,
            "inline_ms": round(inline * 1e3, 3),
            "threads_ms": round(threads * 1e3, 3),
            "threads_speedup": round(inline / threads, 3),
            "auto": stage_executor("auto", stages, [x], CHUNKS),
            "threshold": THREADS_MIN_MACS,
        })  # fmt: skip
    return rows


def _crossover_table(rows: Sequence[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for column in (
        "width",
        "MACs per mb per stage",
        "inline ms",
        "threads ms",
        "threads speed-up",
        "auto picks",
    ):
        table.add_column(column)
    for row in rows:
        table.add_row(
            str(row["width"]), f"{row['macs_per_mb_stage']:.2e}", f"{row['inline_ms']:.2f}",
            f"{row['threads_ms']:.2f}", f"{row['threads_speedup']:.2f}x", row["auto"],
        )  # fmt: skip
    return table


def measure(
    stages: int, *, device: str = "cpu", repeats: int = 20, block: int = 5, only: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Every contender's fixed cost on ``stages`` stages (see the module docstring); ``only``:
    these contenders (``"ort run"``, ``"torch 1f1b checkpoint=never"``, ...)."""
    model, x = tiny_linear(stages)
    device_map: Any = "cpu" if device == "cpu" else {k: "cuda:0" for k in range(stages)}
    contenders = {**_ort_contenders(model, x, device_map), **_torch_contenders(model, x, device_map)}
    rows = []
    for name, fns in contenders.items():
        if only is not None and name not in only:
            continue
        timings = alternate(fns, repeats, warmup=3, block=block)
        wall, cpu = timings.medians(), timings.cpu_medians()
        k1, k16, cpu1, cpu16 = wall["k1"], wall["k16"], cpu["k1"], cpu["k16"]
        extra = (k16 - k1) / CHUNKS
        rows.append({
            "contender": name,
            "stages": stages,
            "device": device,
            "k1_ms": round(k1 * 1e3, 4),
            "k16_ms": round(k16 * 1e3, 4),
            "per_mb_us": round(extra * 1e6, 2),
            "fixed_us": round(extra / stages * 1e6, 2),
            "fixed_cpu_us": round((cpu16 - cpu1) / CHUNKS / stages * 1e6, 2),
            "recompute": "except_last" in name and stages > 1,
            "waits_per_mb_stage": round(ort_waits(fns["k16"], stages), 3) if name.startswith("ort") else None,
        })  # fmt: skip
    return rows


def _table(rows: Sequence[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for column in (
        "device",
        "stages",
        "contender",
        "1 mb ms",
        "16 mb ms",
        "per mb us",
        "per mb per stage us",
        "CPU us",
        "waits",
    ):
        table.add_column(column)
    for row in rows:
        what = row["contender"] + (" (recompute)" if row["recompute"] else "")
        figures = (row["k1_ms"], row["k16_ms"], row["per_mb_us"], row["fixed_us"], row["fixed_cpu_us"])
        waits = "-" if row.get("waits_per_mb_stage") is None else f"{row['waits_per_mb_stage']:.2f}"
        table.add_row(
            row["device"],
            str(row["stages"]),
            what,
            *(f"{v:.3f}" if v < 10 else f"{v:.1f}" for v in figures),
            waits,
        )
    return table


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per device: the medians over the stage counts of the fixed cost (us per micro-batch per
    stage) of the ORT run and of the torch 1F1B step without recomputation, in wall time and
    in CPU time (what ``pl.predict`` takes as ``fixed_cost_s``)."""
    out: dict[str, dict[str, float]] = {}
    for device in sorted({r["device"] for r in rows}):
        mine = [r for r in rows if r["device"] == device]
        figures = {}
        for key, contender in (("ort", "ort run"), ("torch", "torch 1f1b checkpoint=never")):
            chosen = [r for r in mine if r["contender"] == contender]
            if chosen:
                figures[f"{key}_us"] = statistics.median(r["fixed_us"] for r in chosen)
                figures[f"{key}_cpu_us"] = statistics.median(r["fixed_cpu_us"] for r in chosen)
        out[device] = figures
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: the CPU, then the GPU when there is one")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20, help="calls per contender (alternating blocks)")
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--crossover", action="store_true", help="where a thread per stage pays (1F1B, CPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.crossover:
        return _main_crossover(args.repeats, args.out, list(sys.argv[1:] if argv is None else argv))
    devices = ["cpu"] if args.device in ("auto", "cpu") else []
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        devices.append("cuda")
    rows = [row for device in devices for n in args.stages
            for row in measure(n, device=device, repeats=args.repeats, block=args.block)]  # fmt: skip
    env = environment(torch_threads=torch.get_num_threads())
    title = "fixed cost of the pipeline schedule: 16 micro-batches against 1, near-zero compute (medians)"
    print_tables(_table(rows, title), env=env, width=180)
    result = {"environment": env, "repeats": args.repeats, "block": args.block, "rows": rows,
              "summary": summary(rows)}  # fmt: skip
    print(json.dumps(result["summary"]))
    write_results(args.out, result, indent=1)
    return 0


def _main_crossover(repeats: int, out: Path, argv: list[str]) -> int:
    # tcmalloc (else jemalloc) where installed, as benchmarks/pipeline.py runs: under glibc each
    # worker thread's malloc arena is unmapped and faulted in again every step
    again = ["--crossover", *[a for a in argv if a not in ("--crossover", "--fixed-cost")]]
    allocator = choose_allocator("auto", Path(__file__), again)
    env = environment(torch_threads=torch.get_num_threads(), allocator=allocator)
    rows = crossover(repeats=repeats)
    what = "1F1B on 2 CPU stages: one thread for all stages against a thread per stage"
    print_tables(_crossover_table(rows, f"{what} ({allocator}; medians)"), env=env, width=180)
    path = out.with_name(out.stem + "_crossover.json")
    result = {"environment": env, "allocator": allocator, "repeats": repeats, "rows": rows}
    write_results(path, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
