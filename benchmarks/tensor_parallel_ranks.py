"""Benchmark: a tensor-parallel split as 2 gloo ranks against one 1-thread process, in one run.

The model of ``benchmarks/tensor_parallel.py`` (default: the MLP, Linear d=1024 -> GELU ->
Linear 4096 -> 1024, on 256 tokens; ``--models gpt_blocks`` adds 4 GPT blocks) is exported
once (fp32), split with ``pl.split_tensor_parallel(model, devices=[0, 1])`` and saved. One
spawn of two processes on 127.0.0.1 (gloo), each with one intra-op thread, then runs, round
by round interleaved (so a change of machine load hits every contender):

* **1 process, 1 thread**: rank 0 runs the unsplit model lowered by ``pl.to_torch`` while
  rank 1 waits in a barrier;
* **1 process, 2 threads**: the same with 2 intra-op threads (all the cores of a 2-core
  machine; rank 1 waits);
* **emulated split**: rank 0 runs the split model lowered by ``pl.to_torch`` (both devices'
  ops one after the other, the all-reduce a ``Sum`` of copies), one thread;
* **2 ranks**: :class:`placement.distributed.DistributedTensorParallel` on both ranks, each
  its half of the weights, one ``torch.distributed`` all-reduce (gloo) per split layer; the
  time includes broadcasting rank 0's input;
* the same on ONNX Runtime: one ``pl.Runner`` session of the unsplit model (1 thread) against
  2 ranks of :class:`placement.distributed.DistributedTensorParallelRunner` (each its stage
  sessions, 1 thread).

Times are rank 0's wall times between barriers, the median of the rounds. ``vs 1 thread``
is the 1-thread process over the 2 ranks (target: 1.4x). On a machine shared with other work
the second core is not free; ``free cores`` is the ratio the measured CPU times allow when
each rank has a core: the 1-thread process's CPU time over the busier rank's (its half of
the compute, gloo's threads, the input broadcast). ``allreduce`` is one gloo all-reduce of
the split layer's output alone. The rank outputs are compared with the unsplit model
(relative to its largest output) and bitwise with the emulated split.

Usage::

    python benchmarks/tensor_parallel_ranks.py              # writes results/tensor_parallel_ranks.json
    python benchmarks/tensor_parallel_ranks.py --rounds 5 --tokens 64
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "tensor_parallel_ranks.json"

from benchmarks.harness import write_results  # noqa: E402

TARGET = 1.4  # 2 gloo ranks against one 1-thread process
#: the contenders, in the order both ranks run them each round
ORDER = ("1_thread", "2_threads", "emulated", "ranks", "ort_1_thread", "ort_ranks")

__all__ = ["main", "prepare"]


def prepare(name: str, tokens: int, d: int, folder: Path) -> dict[str, Any]:
    """Export the unsplit and the split model of ``name`` into ``folder``; a case for the ranks."""
    import placement as pl
    from benchmarks.tensor_parallel import build

    module, x = build(name, tokens, d)
    base = pl.from_torch(module, (x,))
    split = base.copy()
    result = pl.split_tensor_parallel(split, devices=[0, 1])
    base.save(folder / f"{name}.onnx")
    split.save(folder / f"{name}_tp2.onnx")
    np.save(folder / f"{name}_x.npy", x.numpy())
    return {
        "model": name,
        "tokens": tokens,
        "d_model": d,
        "base": str(folder / f"{name}.onnx"),
        "split": str(folder / f"{name}_tp2.onnx"),
        "x": str(folder / f"{name}_x.npy"),
        "all_reduces": result.all_reduces,
    }


def _timed(fn: Any, barrier: Any) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn`` on this process, between barriers."""
    barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    barrier()
    return elapsed, cpu


def _contenders(
    rank: int, case: dict[str, Any], tp: Any, ort_tp: Any, outputs: dict[str, Any]
) -> dict[str, Any]:
    """What each contender runs on this rank (rank 1 only takes part in the ranks' runs)."""
    import torch

    import placement as pl

    x = np.load(case["x"])
    xt = torch.from_numpy(x)

    def ranks() -> None:
        outputs["ranks"] = tp.run([x] if rank == 0 else None)

    def ort_ranks() -> None:
        outputs["ort_ranks"] = ort_tp.run([x] if rank == 0 else None)

    if rank != 0:
        idle = {k: (lambda: None) for k in ("1_thread", "2_threads", "emulated", "ort_1_thread")}
        return {**idle, "ranks": ranks, "ort_ranks": ort_ranks}
    session = pl.Runner(pl.load(case["base"]), device_map="cpu", threads=1)

    def ort_one() -> None:
        outputs["ort_1_thread"] = session.run([x])[0]

    base = pl.to_torch(pl.load(case["base"]), device_map="cpu")
    split = pl.load(case["split"])
    emulated = pl.to_torch(split, device_map={str(d): "cpu" for d in split.devices})

    def local(key: str, module: Any, threads: int) -> Any:
        def run() -> None:
            torch.set_num_threads(threads)
            try:
                with torch.no_grad():
                    outputs[key] = module(xt).numpy()
            finally:
                torch.set_num_threads(1)

        return run

    return {
        "1_thread": local("1_thread", base, 1),
        "2_threads": local("2_threads", base, 2),
        "emulated": local("emulated", emulated, 1),
        "ranks": ranks,
        "ort_1_thread": ort_one,
        "ort_ranks": ort_ranks,
    }


def _transport(tp: Any, case: dict[str, Any], rounds: int) -> float:
    """Median ms of one gloo all-reduce of the split layer's output (the collective alone)."""
    import torch
    import torch.distributed as dist

    shape = np.load(case["x"]).shape
    buffer = torch.ones(shape)
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _worker(rank: int, world: int, port: int, cases: list[dict[str, Any]], rounds: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from placement.distributed import DistributedTensorParallel, DistributedTensorParallelRunner

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    rows = []
    for case in cases:
        tp = DistributedTensorParallel(case["split"], heartbeat=0)
        ort_tp = DistributedTensorParallelRunner(case["split"], heartbeat=0, threads=1)
        outputs: dict[str, Any] = {}
        contenders = _contenders(rank, case, tp, ort_tp, outputs)
        wall: dict[str, list[float]] = {k: [] for k in ORDER}
        cpu: dict[str, list[float]] = {k: [] for k in ORDER}
        for i in range(rounds + 1):  # the first round warms up
            for key in ORDER:  # one order on both ranks: the barriers and collectives pair up
                fn = contenders[key]
                elapsed, used = _timed(fn, dist.barrier)
                if i:
                    wall[key].append(elapsed)
                    cpu[key].append(used)
        transport = _transport(tp, case, rounds)
        cpu_ranks: list[Any] = [None, None]
        dist.all_gather_object(
            cpu_ranks, (statistics.median(cpu["ranks"]), statistics.median(cpu["ort_ranks"]))
        )

        if rank == 0:
            rows.append(
                _row(case, wall, cpu, cpu_ranks, outputs, transport, tp.issued["forward"] // (rounds + 1))
            )
        tp.close()
        ort_tp.close()
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _row(
    case: dict[str, Any],
    wall: dict[str, list[float]],
    cpu: dict[str, list[float]],
    cpu_ranks: list[Any],
    outputs: dict[str, Any],
    transport: float,
    collectives: int,
) -> dict[str, Any]:
    reference = outputs["1_thread"]
    ranks_out = outputs["ranks"][0]
    ms = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
    cpu_ms = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    cpu_ranks_ort = [c[1] for c in cpu_ranks]
    cpu_ranks = [c[0] for c in cpu_ranks]
    return {
        **{k: case[k] for k in ("model", "tokens", "d_model", "all_reduces")},
        "ms": ms,
        "cpu_ms": cpu_ms,
        "cpu_ms_per_rank": [c * 1e3 for c in cpu_ranks],
        "all_reduce_ms": transport,
        "vs_1_thread": ms["1_thread"] / ms["ranks"],
        "vs_2_threads": ms["2_threads"] / ms["ranks"],
        "vs_emulated": ms["emulated"] / ms["ranks"],
        # what the measured CPU costs allow when each rank has a core of its own
        "free_cores_vs_1_thread": cpu_ms["1_thread"] / (max(cpu_ranks) * 1e3),
        "ort_vs_1_thread": ms["ort_1_thread"] / ms["ort_ranks"],
        "ort_free_cores_vs_1_thread": cpu_ms["ort_1_thread"] / (max(cpu_ranks_ort) * 1e3),
        "ort_max_rel_diff": float(
            np.abs(outputs["ort_ranks"][0] - outputs["ort_1_thread"]).max()
            / np.abs(outputs["ort_1_thread"]).max()
        ),
        "max_rel_diff": float(np.abs(ranks_out - reference).max() / np.abs(reference).max()),
        "bitwise_emulated": bool(np.array_equal(ranks_out, outputs["emulated"])),
        "collectives_per_forward": collectives,
    }


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from placement.distributed import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=["mlp", "gpt_blocks"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cases = [prepare(name, args.tokens, args.d_model, folder) for name in args.models]
        load_before = os.getloadavg()[0]
        out = folder / "rows.pkl"
        mp.spawn(_worker, args=(2, free_port(), cases, args.rounds, str(out)), nprocs=2)
        load_after = os.getloadavg()[0]
        rows = pickle.loads(out.read_bytes())
    print(
        f"{'model':<11} {'1 thread':>10} {'2 threads':>10} {'emulated':>10} {'2 ranks':>10} "
        f"{'vs 1 thr':>9} {'vs 2 thr':>9} {'free cores':>10} {'allreduce':>10} {'rel diff':>9} {'bitwise':>8}"
    )
    for r in rows:
        ms = r["ms"]
        print(
            f"{r['model']:<11} {ms['1_thread']:>8.1f}ms {ms['2_threads']:>8.1f}ms {ms['emulated']:>8.1f}ms "
            f"{ms['ranks']:>8.1f}ms {r['vs_1_thread']:>8.2f}x {r['vs_2_threads']:>8.2f}x "
            f"{r['free_cores_vs_1_thread']:>9.2f}x {r['all_reduce_ms']:>8.2f}ms "
            f"{r['max_rel_diff']:>9.1e} {str(r['bitwise_emulated']):>8}   target: vs 1 thread >= {TARGET}"
        )
    print(
        f"\nONNX Runtime: {'model':<11} {'1 thread':>10} {'2 ranks':>10} "
        f"{'vs 1 thr':>9} {'free cores':>10} {'rel diff':>9}"
    )
    for r in rows:
        ms = r["ms"]
        print(
            f"              {r['model']:<11} {ms['ort_1_thread']:>8.1f}ms {ms['ort_ranks']:>8.1f}ms "
            f"{r['ort_vs_1_thread']:>8.2f}x {r['ort_free_cores_vs_1_thread']:>9.2f}x "
            f"{r['ort_max_rel_diff']:>9.1e}"
        )
    print(
        f"median of {args.rounds} interleaved rounds, {args.tokens} tokens; load average "
        f"{load_before:.2f} before, {load_after:.2f} after; {os.cpu_count()} CPUs"
    )
    payload = {
        "benchmark": "tensor_parallel_ranks",
        "rows": rows,
        "target_vs_1_thread": TARGET,
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
