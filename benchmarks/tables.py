"""Generate ``docs/benchmarks.md`` from ``benchmarks/results/*.json``, so the tables never drift.

Every table in ``docs/benchmarks.md`` is rendered here from the committed results of the
benchmark scripts beside this file; nothing in it is typed by hand. After re-running a
benchmark, regenerate the page::

    python benchmarks/tables.py            # rewrite docs/benchmarks.md
    python benchmarks/tables.py --check    # exit 1 if docs/benchmarks.md is out of date

``tests/test_bench_tables.py`` runs the check.

Example:
    >>> from benchmarks.tables import render
    >>> page = render()
    >>> page.startswith("# Benchmarks") and "| model |" in page
    True
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from benchmarks.table_format import PAGE, RESULTS, fmt, human_bytes, load_results, table  # noqa: E402
from benchmarks.tables_llm import generate, tensor_parallel, tensor_parallel_ranks  # noqa: E402

__all__ = ["render", "main", "PAGE", "RESULTS"]


def _runtime() -> str:
    data = load_results("runtime.json")
    targets = data["targets"]
    rows, explain = [], []
    for r in data["results"]:
        torch_ratio = r.get("torch", {}).get("ratio")
        rows.append(
            [
                r["model"],
                r["plan"],
                r["stages"],
                r["transfers"],
                f"**{r['ratio']:.3f}**",
                " ".join(f"{t:.3f}" for t in r.get("ratio_trials", [])),
                fmt(torch_ratio),
            ]
        )
        e = r.get("explain")
        if e:
            parts = ("cut", "transfers", "binding", "checks", "outputs", "other")
            explain.append([r["model"], r["plan"], *(f"{e[k]:+.2f}" for k in parts)])
    text = table(
        [
            "model",
            "plan",
            "stages",
            "transfers / run",
            f"placed ORT / one session (target <= {targets['ort_placed_over_single']})",
            "the trials",
            f"lowered torch / eager (target <= {targets['torch_lowered_over_eager']})",
        ],
        rows,
    )
    if explain:
        text += (
            "\n\nWhere a placed run's extra time goes (ms per run over the single session; single runs "
            "alternated, so caches are cold for both):\n\n"
            + table(
                [
                    "model",
                    "plan",
                    "cut (extra session calls)",
                    "transfers",
                    "stage I/O",
                    "checks",
                    "outputs",
                    "rest (noise)",
                ],
                explain,
            )
        )
    return text


def _torch_lowering() -> str:
    data = load_results("torch_lowering.json")
    rows = [
        [
            r["model"],
            r["threads"],
            r["ops"],
            r["copies"],
            fmt(r["eager_ms"]),
            fmt(r["lowered_ms"]),
            f"**{r['ratio']:.3f}**",
            f"{r['max_abs_diff']:.1e}",
        ]
        for r in data["results"]
    ]
    header = [
        "model",
        "threads",
        "ops",
        "copies",
        "eager ms",
        "lowered ms",
        f"lowered / eager (target <= {data['target_ratio']})",
        "max abs diff",
    ]
    return table(header, rows)


_PIPELINE_ROWS: list[tuple[str, str, Callable[[dict], Any], Callable[[dict], Any], str]] = [
    (
        "ORT",
        "`run(chunks=8)` / one session",
        lambda r: r["ort"]["run_ratio"],
        lambda r: r["ort"]["work"]["run"],
        "ort_run_chunks8",
    ),
    (
        "ORT",
        "`stream` / one session",
        lambda r: r["ort"]["stream_ratio"],
        lambda r: r["ort"]["work"]["stream"],
        "ort_stream",
    ),
    (
        "torch",
        "forward `to_torch(chunks=8)` / eager",
        lambda r: r["torch"]["forward_ratio"]["pipelined"],
        lambda r: r["torch"]["forward_work"]["pipelined"],
        "torch_forward",
    ),
    (
        "torch",
        "forward torchgpipe `GPipe` / eager",
        lambda r: r["torch"]["forward_ratio"]["torchgpipe"],
        lambda r: r["torch"]["forward_work"]["torchgpipe"],
        "",
    ),
    (
        "torch",
        "train step `module.train_step(x, loss_fn=...)` / eager",
        lambda r: r["torch"]["train_ratio"]["train_step"],
        lambda r: r["torch"]["train_work"]["train_step"],
        "torch_train",
    ),
    (
        "torch",
        "train step `loss_fn(module(x)).backward()` / eager",
        lambda r: r["torch"]["train_ratio"]["pipelined"],
        lambda r: r["torch"]["train_work"]["pipelined"],
        "",
    ),
    (
        "torch",
        "train step torchgpipe `GPipe` / eager",
        lambda r: r["torch"]["train_ratio"]["torchgpipe"],
        lambda r: r["torch"]["train_work"]["torchgpipe"],
        "",
    ),
]


def _pipeline() -> str:
    data = load_results("pipeline.json")
    targets = data["targets"]
    rows, sweep = [], []
    for r in data["results"]:
        for runtime, contender, ratio, work, target in _PIPELINE_ROWS:
            try:
                value, cpu = ratio(r), work(r)
            except KeyError:
                continue
            goal = targets.get(target)
            rows.append(
                [
                    r["model"],
                    runtime,
                    contender,
                    f"**{value:.2f}**" if goal else f"{value:.2f}",
                    f">= {goal}" if goal else "",
                    fmt(cpu),
                ]
            )
        sweep.append([r["model"], *(f"{s['speedup']:.2f}" for s in r["sweep"])])
        chunks = [s["chunks"] for s in r["sweep"]]
    env = data["environment"]
    text = (
        f"Throughput over the baseline, both on 2 stages with {env['torch_threads']} thread per stage, "
        f"allocator {env['allocator']}; torch rows are medians of {data['results'][0]['torch']['trials']} "
        "trials. *CPU work* is the contender's CPU time over the baseline's.\n\n"
        + table(["model", "runtime", "contender", "ratio", "target", "CPU work / baseline"], rows)
    )
    bubbles = ", ".join(f"{s['gpipe_bubble']:.2f}" for s in data["results"][0]["sweep"])
    text += (
        "\n\nChunks sweep (ORT `Runner.run`, 2 stages; the GPipe bubble `(N-1)/(k+N-1)` is "
        f"{bubbles}):\n\n" + table(["model", *(f"k = {k}" for k in chunks)], sweep)
    )
    return text


def _training_memory() -> str:
    data = load_results("training_memory.json")
    gpipe = {r["model"]: r["step_mib"] for r in data["results"] if r["contender"] == "gpipe"}
    names = {
        "eager": "eager module",
        "gpipe": "`loss_fn(module(x)).backward()` (GPipe)",
        "train_step": "`module.train_step`",
        "train_step_bounded": "`module.train_step(max_in_flight=2)`",
    }
    rows = [
        [
            r["model"],
            names.get(r["contender"], r["contender"]),
            f"{r['step_mib']:.0f} MiB",
            fmt(r["step_mib"] / gpipe[r["model"]]),
        ]
        for r in data["results"]
    ]
    return (
        f"Peak memory of {data['steps']} training steps above the built model, each contender in a fresh "
        f"process ({data['size']} models, `chunks={data['chunks']}`):\n\n"
        + table(["model", "contender", "step memory", "/ GPipe"], rows)
    )


def _passes() -> str:
    rows = []
    for name in ("passes.json", "passes_scatter.json"):
        data = load_results(name)
        for r in data["rows"]:
            rows.append(
                [
                    data["scenario"],
                    f"{r['ops']:,}",
                    f"{r['copies']:,}",
                    f"**{r['best_s']:.3f} s**",
                    f"{r['discover_s']:.3f}",
                    f"{r['shift_s']:.3f}",
                    f"{r['inject_s']:.3f}",
                    f"{r['ops_per_s']:,.0f}",
                ]
            )
    return (
        "Activation discovery + shift + copy injection, best of 3 (`half`: the second half on another "
        "device, 2 copies; `scatter`: every other block on another device):\n\n"
        + table(["scenario", "ops", "copies", "total", "discover s", "shift s", "inject s", "ops / s"], rows)
    )


def _planners() -> str:
    data = load_results("planners.json")
    rows = []
    for r in data["rows"]:
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "**no**")
        method = "**ours**" if r["method"] == "ours" else r["method"]
        budget = r["scenario"] if r["budget"] is None else human_bytes(r["budget"])
        rows.append(
            [
                r["model"],
                r["devices"],
                budget,
                method,
                f"{r['bottleneck_ms']:.2f} ms",
                f"{r['ratio']:.3f}",
                f"{r['with_links_ms']:.2f} ms",
                human_bytes(r["transfer_bytes"]),
                human_bytes(r["peak_device_memory"]),
                fits,
            ]
        )
    peers = ", ".join(f"{k} {v}" for k, v in data["peers"].items())
    return (
        f"`{data['size']}` models; peers: {peers}; *with links*: every placement scored with copy "
        f"times on `--links {data['links']}`.\n\n"
        + table(
            [
                "model",
                "N",
                "budget",
                "planner",
                "bottleneck",
                "x lower bound",
                "with links",
                "copied / step",
                "peak memory",
                "fits",
            ],
            rows,
        )
    )


def _distributed() -> str:
    data = load_results("distributed.json")
    rows = [
        [
            r["model"],
            r["micro"],
            f"{r['ratio']:.2f}",
            f"{r['ideal_ratio']:.2f}",
            f"{r['ort_ratio']:.2f}",
            f"{r['gloo_ms_per_mb']:.2f}",
            f"{r['cpu_overhead_ms_per_mb']:.2f}",
        ]
        for r in data["rows"]
    ]
    s = data["settings"]
    return (
        f"2 gloo ranks on loopback, 1 thread each, {s['chunks']} micro-batches per step, against one "
        "process running the same micro-batches in turn (throughput ratios; `m` = rows per micro-batch):\n\n"
        + table(
            [
                "model",
                "m",
                "torch ranks",
                "ideal (stage times)",
                "ORT ranks",
                "gloo ms / micro-batch",
                "torch overhead ms / micro-batch",
            ],
            rows,
        )
    )


_CONFORMANCE_NAMES = {
    "ort": "ONNX Runtime, one session",
    "placed_last": "`pl.run`, last op moved to device 1",
    "placed_alternate": "`pl.run`, every other op moved",
    "torch": "`pl.to_torch` (forward)",
}


def _conformance() -> str:
    data = load_results("conformance.json")
    ort = next(r["passed"] for r in data["results"] if r["runtime"] == "ort")
    rows = [
        [
            _CONFORMANCE_NAMES.get(r["runtime"], r["runtime"]),
            f"{r['passed']} / {r['cases']}",
            f"{r['tensor_passed']} / {r['tensor_cases']}",
            f"{r['passed'] / ort:.3f}",
        ]
        for r in data["results"]
    ]
    versions = ", ".join(f"{k} {v}" for k, v in data["versions"].items())
    return f"Versions: {versions}.\n\n" + table(
        ["runtime", "cases passed", "plain-tensor cases passed", "vs ONNX Runtime"], rows
    )


def _bigmodel() -> str:
    data = load_results("bigmodel.json")
    weights = data["weight_bytes"]
    rows = [
        [
            f"`{r['step']}`",
            f"{r['peak'] / 2**30:.2f} GiB",
            f"{r['peak'] / weights:.2f}",
            f"{r['seconds']:.1f}",
        ]
        for r in data["results"]["placement"]
    ]
    rows += [
        [
            f"baseline: {r['step']}",
            f"{r['peak'] / 2**30:.2f} GiB",
            f"{r['peak'] / weights:.2f}",
            f"{r['seconds']:.1f}",
        ]
        for r in data["results"]["baseline"]
    ]
    target = data["target"]["load_place_save_peak_over_weights"]
    return (
        f"A {weights / 2**30:.1f} GiB model (W); peak resident memory of each step in one fresh process "
        f"(target for load + place + save: < {target} x W):\n\n"
        + table(["step", "peak RSS", "peak / W", "seconds"], rows)
    )


#: (title, command that writes the results, renderer), in page order.
SECTIONS: list[tuple[str, str, Callable[[], str]]] = [
    (
        "Placed ONNX Runtime and lowered torch against one session / eager",
        "python benchmarks/runtime.py --models gpt resnet hf-gpt2 --threads 1 --block 5 --repeats 150 "
        "--explain",
        _runtime,
    ),
    ("Lowered torch module against eager", "python benchmarks/torch_lowering.py", _torch_lowering),
    ("Pipelining and training", "python benchmarks/pipeline.py", _pipeline),
    ("Training memory", "python benchmarks/training_memory.py", _training_memory),
    (
        "Pass throughput",
        "python benchmarks/passes.py; python benchmarks/passes.py --scenario scatter",
        _passes,
    ),
    ("Planners", "python benchmarks/planners.py --markdown", _planners),
    ("Tensor parallelism", "python benchmarks/tensor_parallel.py", tensor_parallel),
    (
        "torch.distributed ranks",
        "python benchmarks/distributed.py --micro-batches 2 8 16 --chunks 8",
        _distributed,
    ),
    (
        "Tensor-parallel ranks",
        "python benchmarks/tensor_parallel_ranks.py --models mlp gpt_blocks",
        tensor_parallel_ranks,
    ),
    ("ONNX node-test conformance", "python benchmarks/conformance.py", _conformance),
    ("Big models", "python benchmarks/bigmodel.py", _bigmodel),
    (
        "Generation (LLM decode loops)",
        "PLACEMENT_GENAI_PYTHON=/path/to/genai-venv/bin/python python benchmarks/generate.py",
        generate,
    ),
]


_INTRO = """# Benchmarks

<!-- Generated by benchmarks/tables.py from benchmarks/results/*.json; do not edit by hand. -->

Every table below is rendered from the committed JSON results in `benchmarks/results/` by
`python benchmarks/tables.py`; `tests/test_bench_tables.py` fails when this page and the results
disagree. Each benchmark runs its contenders side by side in one process (or alternated fresh
processes), so ratios compare like with like; absolute times depend on the machine. Unless a section
says otherwise, the results come from a 2-core x86_64 CPU without GPUs, where every logical device
is *emulated* on the CPU: ratios there measure the cost of splitting, not a multi-GPU speed-up.
What each number means, and why the runtimes behave as they do, is in
[runtimes.md](runtimes.md), [pipelining.md](pipelining.md), [planning.md](planning.md),
[distributed.md](distributed.md), [conformance.md](conformance.md) and [big-models.md](big-models.md).
"""


def render() -> str:
    """The whole ``docs/benchmarks.md`` page, from the JSON results."""
    parts = [_INTRO]
    for title, command, renderer in SECTIONS:
        parts.append(f"## {title}\n\nReproduce: `{command}`\n\n{renderer()}\n")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with ``--check``, compare) ``docs/benchmarks.md``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is out of date: run python benchmarks/tables.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
