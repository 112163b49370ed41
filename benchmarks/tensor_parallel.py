"""Benchmark: tensor parallelism on 2 emulated devices against one session, side by side in one run.

Two models, each exported once (fp32) and run three ways on the same input:

* **1-thread session**: the unsplit model as one ONNX Runtime session with one intra-op thread;
* **2-thread session**: the same with two intra-op threads (all the cores of a 2-core machine);
* **tensor parallel**: ``pl.split_tensor_parallel(model, devices=[0, 1])`` run by
  ``pl.Runner(device_map={0: "cpu", 1: "cpu"}, fold=False)``: one session per device stage,
  the two branches of every split layer at once (:mod:`placement.runtime.ort.concurrent`),
  one intra-op thread each, the all-reduces as ``Sum`` s of the two partials.

The torch runtime (``--torch-models``, default the MLP) is timed the same way in its own
alternating blocks: eager torch with one and with two intra-op threads, against ``pl.to_torch``
of the split model (its branches at once: a worker thread per stage, one intra-op thread each,
:mod:`placement.runtime.torch.concurrent`) and of the same split run as a chain
(``concurrent=False``, two threads), all under ``torch.no_grad()``.

Models: an MLP (Linear d=1024 -> GELU -> Linear 4096 -> 1024) on 256 tokens (targets: 1.7x the
1-thread session, 0.9x the 2-thread one), and a stack of 4 GPT blocks (``placement.models.gpt``,
d=1024, 16 heads, ff=4096) on 256 tokens (target 1.5x the 1-thread session). Runs of the
contenders are interleaved, round by round, so a change of machine load hits all of them; the
median of the rounds is reported with the load average before and after. The exactness column
is the largest difference to the 1-thread session relative to its largest output.

Usage::

    python benchmarks/tensor_parallel.py            # prints the table, writes results/tensor_parallel.json
    python benchmarks/tensor_parallel.py --rounds 5 --tokens 64   # a quick run
    python benchmarks/tensor_parallel.py --torch-models mlp gpt_blocks  # torch rows for both
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "tensor_parallel.json"

from benchmarks.harness import write_results  # noqa: E402

TARGETS = {"mlp": {"vs_1_thread": 1.7, "vs_2_threads": 0.9}, "gpt_blocks": {"vs_1_thread": 1.5}}

__all__ = ["main", "build", "measure"]


def build(name: str, tokens: int, d: int = 1024) -> tuple[nn.Module, torch.Tensor]:
    """The module and its input: ``mlp`` or ``gpt_blocks`` (4 blocks)."""
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)).eval(), torch.randn(
            tokens, d
        )
    from placement.models import gpt

    config = gpt.GPTConfig(vocab_size=64, block_size=tokens, n_layer=4, n_head=16, d_model=d)
    return nn.Sequential(*[gpt.Block(config) for _ in range(4)]).eval(), torch.randn(1, tokens, d)


def measure(name: str, tokens: int, rounds: int, d: int = 1024) -> dict[str, Any]:
    """Time the three contenders on one model; a results row."""
    import placement as pl

    module, x = build(name, tokens, d)
    base = pl.from_torch(module, (x,))
    split = base.copy()
    result = pl.split_tensor_parallel(split, devices=[0, 1])
    runners = {
        "1_thread": pl.Runner(base, device_map="cpu", threads=1),
        "2_threads": pl.Runner(base, device_map="cpu", threads=2),
        "tensor_parallel": pl.Runner(split, device_map={0: "cpu", 1: "cpu"}, fold=False),
    }
    feeds = [x.numpy()]
    reference = runners["1_thread"].run(feeds)[0]
    out = runners["tensor_parallel"].run(feeds)[0]
    exact = float(np.abs(out - reference).max() / np.abs(reference).max())
    times: dict[str, list[float]] = {key: [] for key in runners}
    for runner in runners.values():  # warm up
        runner.run(feeds)
    for _ in range(rounds):
        for key, runner in runners.items():
            start = time.perf_counter()
            runner.run(feeds)
            times[key].append(time.perf_counter() - start)
    ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    return {
        "model": name,
        "tokens": tokens,
        "d_model": d,
        "ms": ms,
        "vs_1_thread": ms["1_thread"] / ms["tensor_parallel"],
        "vs_2_threads": ms["2_threads"] / ms["tensor_parallel"],
        "max_rel_diff": exact,
        "all_reduces": result.all_reduces,
        "stages": len(runners["tensor_parallel"].stages),
        "concurrent": runners["tensor_parallel"].program.concurrent is not None,
    }


def _torch_block(fn: Any, threads: int, calls: int) -> tuple[float, float]:
    """Seconds per call of ``fn`` over ``calls`` calls, with ``threads`` intra-op threads: the
    wall time, and the CPU time of the process (all its threads)."""
    torch.set_num_threads(threads)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls, (time.process_time() - cpu) / calls


def measure_torch(name: str, tokens: int, rounds: int, d: int = 1024, calls: int = 3) -> dict[str, Any]:
    """Time eager torch (1 and 2 threads) against ``pl.to_torch`` of the split model, its
    branches at once and as a chain, in alternating blocks of ``calls`` calls; a results row."""
    import placement as pl

    module, x = build(name, tokens, d)
    split = pl.from_torch(module, (x,))
    pl.split_tensor_parallel(split, devices=[0, 1])
    cpus = {0: "cpu", 1: "cpu"}
    concurrent = pl.to_torch(split, device_map=cpus)  # the default: at once, where it pays
    chain = pl.to_torch(split, device_map=cpus, concurrent=False)
    contenders = {  # name -> (function, the caller's intra-op threads)
        "eager_1_thread": (lambda: module(x), 1),
        "eager_2_threads": (lambda: module(x), 2),
        "to_torch_split": (lambda: concurrent(x), 2),
        "to_torch_split_chain": (lambda: chain(x), 2),
    }
    threads = torch.get_num_threads()
    times: dict[str, list[float]] = {key: [] for key in contenders}
    cpu: dict[str, list[float]] = {key: [] for key in contenders}
    try:
        with torch.no_grad():
            reference = module(x)
            out = concurrent(x)
            for fn, n in contenders.values():  # warm up (traces, thread pools)
                _torch_block(fn, n, 2)
            for _ in range(rounds):
                for key, (fn, n) in contenders.items():
                    wall, used = _torch_block(fn, n, calls)
                    times[key].append(wall)
                    cpu[key].append(used)
    finally:
        torch.set_num_threads(threads)
    ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    stats = getattr(concurrent, "stats", None)
    return {
        "model": name,
        "tokens": tokens,
        "d_model": d,
        "ms": ms,
        "cpu_ms": {key: statistics.median(values) * 1e3 for key, values in cpu.items()},
        "vs_1_thread": ms["eager_1_thread"] / ms["to_torch_split"],
        "vs_2_threads": ms["eager_2_threads"] / ms["to_torch_split"],
        "vs_chain": ms["to_torch_split_chain"] / ms["to_torch_split"],
        "max_rel_diff": float((out - reference).abs().max() / reference.abs().max()),
        "concurrent": int(stats.concurrent) if stats is not None else 0,
        "calls_per_block": calls,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt_blocks"], choices=["mlp", "gpt_blocks"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--torch-models", nargs="*", default=["mlp"], choices=["mlp", "gpt_blocks"])
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = [measure(name, args.tokens, args.rounds, args.d_model) for name in args.models]
    torch_rows = [measure_torch(name, args.tokens, args.rounds, args.d_model) for name in args.torch_models]
    load_after = os.getloadavg()[0]
    header = f"{'model':<11} {'1 thread':>10} {'2 threads':>10} {'TP x2':>10} "
    header += f"{'vs 1 thr':>9} {'vs 2 thr':>9} {'rel diff':>9}"
    print(header)
    for r in rows:
        ms = r["ms"]
        target = TARGETS[r["model"]]
        print(
            f"{r['model']:<11} {ms['1_thread']:>8.1f}ms {ms['2_threads']:>8.1f}ms "
            f"{ms['tensor_parallel']:>8.1f}ms "
            f"{r['vs_1_thread']:>8.2f}x {r['vs_2_threads']:>8.2f}x {r['max_rel_diff']:>9.1e}"
            f"   targets: {', '.join(f'{k} >= {v}' for k, v in target.items())}"
        )
    if torch_rows:
        print(f"\n{'torch':<11} {'eager 1':>10} {'eager 2':>10} {'split':>10} {'chain':>10} "
              f"{'vs 1 thr':>9} {'vs 2 thr':>9} {'vs chain':>9} {'rel diff':>9}")
    for r in torch_rows:
        ms = r["ms"]
        print(
            f"{r['model']:<11} {ms['eager_1_thread']:>8.1f}ms {ms['eager_2_threads']:>8.1f}ms "
            f"{ms['to_torch_split']:>8.1f}ms {ms['to_torch_split_chain']:>8.1f}ms "
            f"{r['vs_1_thread']:>8.2f}x {r['vs_2_threads']:>8.2f}x {r['vs_chain']:>8.2f}x "
            f"{r['max_rel_diff']:>9.1e}   branches at once: {r['concurrent']}; CPU ms per call: "
            f"eager 1 thread {r['cpu_ms']['eager_1_thread']:.1f}, split {r['cpu_ms']['to_torch_split']:.1f}"
        )
    print(
        f"median of {args.rounds} interleaved rounds; "
        f"load average {load_before:.2f} before, {load_after:.2f} after; "
        f"{os.cpu_count()} CPUs"
    )
    payload = {
        "benchmark": "tensor_parallel",
        "rows": rows,
        "torch_rows": torch_rows,
        "targets": TARGETS,
        "rounds": args.rounds,
        "load_average": [load_before, load_after],
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
    write_results(args.output, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
