"""The tables of ``docs/benchmarks.md`` for tensor parallelism (one process and ranks) and
generation (:mod:`benchmarks.tables` puts them on the page).

Example:
    >>> "| model |" in generate() and "| model |" in tensor_parallel()
    True
"""

from __future__ import annotations

from benchmarks.table_format import load_results, table

__all__ = ["generate", "tensor_parallel", "tensor_parallel_ranks"]


def tensor_parallel() -> str:
    data = load_results("tensor_parallel.json")
    rows = [
        [
            r["model"],
            r["tokens"],
            f"{r['ms']['1_thread']:.1f}",
            f"{r['ms']['2_threads']:.1f}",
            f"{r['ms']['tensor_parallel']:.1f}",
            f"{r['vs_1_thread']:.2f}",
            f"{r['vs_2_threads']:.2f}",
            f"{r['max_rel_diff']:.1e}",
        ]
        for r in data["rows"]
    ]
    load = data["load_average"]
    return (
        f"`pl.split_tensor_parallel` over 2 emulated devices (one session and one thread each, "
        f"branches at once) against one unsplit session; median of {data['rounds']} interleaved rounds, "
        f"load average {load[0]:.2f} before and {load[1]:.2f} after, {data['cpus']} CPUs:\n\n"
        + table(
            [
                "model",
                "tokens",
                "1 thread ms",
                "2 threads ms",
                "TP x2 ms",
                "vs 1 thread",
                "vs 2 threads",
                "max rel diff",
            ],
            rows,
        )
        + "\n\nThe full run (both models, 15 interleaved rounds) takes about a minute on an idle 2-core "
        "machine. The ratios test the targets only while the load average stays below the core count: "
        "under load the 2-thread session runs slower than the 1-thread one, which no idle machine shows.\n"
        + _tensor_parallel_torch(data)
    )


def _tensor_parallel_torch(data: dict) -> str:
    keys = ["eager_1_thread", "eager_2_threads", "to_torch_split", "to_torch_split_chain"]
    rows = [
        [
            r["model"],
            r["tokens"],
            *(f"{r['ms'][k]:.1f}" for k in keys),
            *(f"{r[k]:.2f}" for k in ("vs_1_thread", "vs_2_threads", "vs_chain")),
            f"{r['max_rel_diff']:.1e}",
        ]
        for r in data.get("torch_rows", [])
    ]
    head = [
        "model",
        "tokens",
        "eager 1 thread ms",
        "eager 2 threads ms",
        "split ms",
        "split chain ms",
        "vs 1 thread",
        "vs 2 threads",
        "vs chain",
        "max rel diff",
    ]
    return (
        ""
        if not rows
        else (
            "\nThe torch runtime in the same run: eager torch with 1 and 2 intra-op threads against "
            "`pl.to_torch` of the split model, its branches at once (a worker thread per stage, one "
            "intra-op thread each) and as a chain (`concurrent=False`, 2 threads), under `torch.no_grad()`, "
            "in alternating blocks:\n\n" + table(head, rows) + "\n"
        )
    )


def tensor_parallel_ranks() -> str:
    data = load_results("tensor_parallel_ranks.json")
    torch_rows, ort_rows = [], []
    for r in data["rows"]:
        ms = r["ms"]
        torch_rows.append(
            [
                r["model"],
                f"{ms['1_thread']:.1f}",
                f"{ms['2_threads']:.1f}",
                f"{ms['emulated']:.1f}",
                f"{ms['ranks']:.1f}",
                f"{r['vs_1_thread']:.2f}",
                f"{r['vs_2_threads']:.2f}",
                f"{r['free_cores_vs_1_thread']:.2f}",
                f"{r['all_reduce_ms']:.2f}",
                f"{r['max_rel_diff']:.1e}",
                "yes" if r["bitwise_emulated"] else "**no**",
            ]
        )
        ort_rows.append(
            [
                r["model"],
                f"{ms['ort_1_thread']:.1f}",
                f"{ms['ort_ranks']:.1f}",
                f"{r['ort_vs_1_thread']:.2f}",
                f"{r['ort_free_cores_vs_1_thread']:.2f}",
                f"{r['ort_max_rel_diff']:.1e}",
            ]
        )
    load = data["load_average"]
    return (
        "`pl.split_tensor_parallel(model, devices=[0, 1])` run as 2 gloo ranks (1 thread each, one "
        "`dist.all_reduce` per split layer, the input broadcast included) against one process running the "
        f"unsplit model; median of {data['rounds']} interleaved rounds, load average {load[0]:.2f} "
        f"before and {load[1]:.2f} after, {data['cpus']} CPUs. torch: `DistributedTensorParallel` "
        "against the unsplit model lowered by `pl.to_torch` (target: 2 ranks at least "
        f"{data['target_vs_1_thread']}x one 1-thread process); `free cores` is the ratio the ranks' "
        "CPU times allow:\n\n"
        + table(
            [
                "model",
                "1 thread ms",
                "2 threads ms",
                "emulated split ms",
                "2 ranks ms",
                "vs 1 thread",
                "vs 2 threads",
                "free cores",
                "all-reduce ms",
                "max rel diff",
                "bitwise = emulated",
            ],
            torch_rows,
        )
        + "\n\nONNX Runtime: `DistributedTensorParallelRunner` (each rank its stage sessions, 1 thread) "
        "against one `pl.Runner` session of the unsplit model (1 thread):\n\n"
        + table(["model", "1 thread ms", "2 ranks ms", "vs 1 thread", "free cores", "max rel diff"], ort_rows)
    )


def generate() -> str:
    data = load_results("generate.json")
    columns = list(max((r["tokens_per_s"] for r in data["results"]), key=len))  # the widest row's
    targets = data["targets"]
    per_row = any("load_average" in r for r in data["results"])
    rows = []
    for r in data["results"]:
        tps = r["tokens_per_s"]
        cells = [r["model"], r["batch"], *("-" if tps.get(c) is None else f"{tps[c]:.0f}" for c in columns)]
        cells += [f"**{r['ratios'][t]:.2f}**" if t in r["ratios"] else "-" for t in targets]
        load_row = " ".join(f"{x:.1f}" for x in r.get("load_average", [])) or "-"
        cells += [load_row] if per_row else []
        rows.append(cells)
    named = (t if v is None else f"{t} (target {v})" for t, v in targets.items())
    header = ["model", "batch", *columns, *named, *(["load after the row"] if per_row else [])]
    load = data["load_average"]
    return (
        f"Tokens per second, greedy, prompt {data['prompt']}, {data['new_tokens']} new tokens, best of "
        f"{data['repeats']}; ratios as each column says (the d=1024 model's 2-device target is 0.9). "
        f"Load average (1, 5, 15 min) before {load['before']}, after {load['after']} on {data['cpus']} "
        f"CPUs: a loaded machine slows every contender, the ratios less so. "
        + (data["note"] + " " if "note" in data else "")
        + "See [generation.md](generation.md).\n\n"
        + table(header, rows)
    )
