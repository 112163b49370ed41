"""Benchmark: 2 torch.distributed ranks (gloo, loopback) against 1 process, by micro-batch size.

For each model (bench size) and micro-batch size ``m``, the model is exported
with batch ``m`` (its graph is static: one micro-batch), placed on 2 logical
devices (balanced by measured op time, or evenly with ``--split even``), saved,
and run on ``k`` micro-batches (``--chunks``, default 16) in one spawn of two
processes, each with 1 intra-op thread:

* **1 process**: rank 0 runs the whole lowered module (``pl.to_torch``) over the
  ``k`` micro-batches, one after the other, while rank 1 waits in a barrier;
* **2 ranks**: :class:`placement.distributed.DistributedPipeline` with
  ``ScheduleGPipe`` (torch.distributed.pipelining), rank 0 -> rank 1 over gloo.

The same on ONNX Runtime (columns ``ort``): one ``pl.Runner`` (1 intra-op thread
per session) over the ``k`` micro-batches against 2 ranks of
:class:`placement.distributed.DistributedRunner` (each rank its stage sessions, 1
thread, activations over gloo, fill-drain); ``ort free cores`` is the ratio the
measured CPU times allow when each rank has a core: one process's CPU time over
``(k + 1) / k`` times the busier rank's (its sessions, the wires, gloo's threads).

Both alternate repeat by repeat in the same processes. The ratio is
1-process time / 2-rank time for the same rows (2.0 is perfect). The breakdown
says where the per-micro-batch time of the 2-rank run goes:

* ``stage 0`` / ``stage 1``: each rank's stage module alone, per micro-batch;
* ``ideal``: the fill-drain bound ``t0 + (k - 1) * max(t0, t1) + t1`` and the
  ratio it allows;
* ``gloo``: sending one micro-batch's boundary activations rank 0 -> rank 1 with
  plain ``isend``/``irecv`` (the transport alone);
* ``sched``: what torch's schedule adds per micro-batch beyond ideal compute
  (2-rank time of ``schedule.eval`` on tensors, minus ideal, divided by ``k``);
* ``ours``: what :meth:`DistributedPipeline.run` adds per call over the bare
  ``schedule.eval`` (input checks, numpy <-> torch, output copies);
* from CPU time, which waiting for a busy core does not inflate: ``cpu ovh/mb``,
  the CPU per micro-batch of the busier rank beyond its stage's compute
  (schedule + gloo + ours), and ``2 free cores``, the ratio the measured CPU
  costs allow when each rank has a core of its own.

Usage::

    python benchmarks/distributed.py                          # gpt and resnet, m = 1 2 4 8, k = 16
    python benchmarks/distributed.py --models gpt --micro-batches 1 4 --chunks 8 --repeats 5

Writes ``benchmarks/results/distributed.json``. Cores shared with other work
make the 2-rank numbers noisy (two busy processes need two free cores): the
table prints the machine's load average next to the results.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import placement as pl  # noqa: E402
from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import environment, environment_line, median_ms, write_results  # noqa: E402
from placement import models  # noqa: E402

RESULTS = RESULTS_DIR / "distributed.json"
TARGET = 1.6


def prepare(name: str, micro: int, chunks: int, folder: Path, *, split: str = "time") -> dict[str, Any]:
    """Export ``name`` (bench) with batch ``micro``, place it on 2 devices, save model and inputs."""
    import torch

    net, args = models.build(name, "bench")
    x = args[0]
    reps = -(-micro // x.shape[0])
    one = torch.cat([x] * reps)[:micro]
    model = pl.from_torch(net, (one,))
    if split == "time":
        pl.balance(model, pl.balance_by_time(model, 2, repeats=3))
        pl.inject_cross_device_copies(model)
    else:
        pl.place_evenly(model, 2)
    path = folder / f"{name}_m{micro}.onnx"
    model.save(path)
    rng = np.random.default_rng(0)
    rows = micro * chunks
    if x.dtype == torch.int64:
        batch = rng.integers(0, int(x.max()) + 1, size=(rows, *x.shape[1:]), dtype=np.int64)
    else:
        batch = rng.standard_normal((rows, *x.shape[1:])).astype(np.float32)
    np.save(folder / f"{name}_m{micro}.npy", batch)
    return {
        "model": name,
        "micro": micro,
        "chunks": chunks,
        "path": str(path),
        "inputs": str(folder / f"{name}_m{micro}.npy"),
    }


def _worker(rank: int, world: int, port: int, configs: list[dict[str, Any]], repeats: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from placement.distributed import DistributedPipeline, DistributedRunner, rank_groups, split_by_rank

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    rows_out = []
    for cfg in configs:
        k, m = cfg["chunks"], cfg["micro"]
        pipe = DistributedPipeline(cfg["path"], chunks=k)
        ort = DistributedRunner(cfg["path"], chunks=k, threads=1)
        batch = np.load(cfg["inputs"])
        tensors = (torch.from_numpy(batch),)
        schedule = pipe._schedule(k, training=False)
        full = stages = runner = None
        mbs = [torch.from_numpy(batch[i * m : (i + 1) * m]) for i in range(k)]
        if rank == 0:
            model = pl.load(cfg["path"])
            full = pl.to_torch(model, device_map="cpu")
            stages = split_by_rank(full, rank_groups(model)).stages
            runner = pl.Runner(model, device_map="cpu", threads=1)
        times: dict[str, list[float]] = {
            key: [] for key in ("single", "pipe", "eval", "gloo", "s0", "s1", "ort_single", "ort_pipe")
        }
        cpu: dict[str, list[float]] = {
            "single": [],
            "s0": [],
            "s1": [],
            "pipe": [],
            "ort_single": [],
            "ort": [],
        }
        with torch.no_grad():
            boundary = stages[0](mbs[0]) if rank == 0 else None
            box = [None if boundary is None else [(t.shape, t.dtype) for t in boundary]]
            dist.broadcast_object_list(box, src=0)
            recv = [torch.empty(shape, dtype=dtype) for shape, dtype in box[0]]
            for rep in range(repeats + 1):  # the first round warms up
                dist.barrier()
                if rank == 0:
                    t, c = time.perf_counter(), time.process_time()
                    for mb in mbs:
                        full(mb)
                    single, single_cpu = time.perf_counter() - t, time.process_time() - c
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                pipe.run([batch] if rank == 0 else None)
                pipe_cpu = time.process_time() - c
                dist.barrier()
                piped = time.perf_counter() - t
                if rank == 0:
                    t, c = time.perf_counter(), time.process_time()
                    for mb in mbs:
                        runner.run([mb.numpy()])
                    ort_single, ort_single_cpu = time.perf_counter() - t, time.process_time() - c
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                ort.run([batch] if rank == 0 else None)
                ort_cpu = time.process_time() - c
                dist.barrier()
                ort_piped = time.perf_counter() - t
                dist.barrier()
                t = time.perf_counter()
                schedule.eval(*tensors) if rank == 0 else schedule.eval()
                dist.barrier()
                bare = time.perf_counter() - t
                dist.barrier()
                t = time.perf_counter()
                for _ in range(k):
                    if rank == 0:
                        works = [dist.isend(v, 1) for v in boundary]
                    else:
                        works = [dist.irecv(v, 0) for v in recv]
                    for w in works:
                        w.wait()
                dist.barrier()
                comm = time.perf_counter() - t
                if rank == 0:
                    t, c = time.perf_counter(), time.process_time()
                    for mb in mbs:
                        stages[0](mb)
                    s0, s0_cpu = time.perf_counter() - t, time.process_time() - c
                    t, c = time.perf_counter(), time.process_time()
                    for _ in range(k):
                        stages[1](*boundary)
                    s1, s1_cpu = time.perf_counter() - t, time.process_time() - c
                if rep == 0:
                    continue
                both = [None, None]
                dist.all_gather_object(both, (pipe_cpu, ort_cpu))
                if rank != 0:
                    continue
                cpu["pipe"].append(max(b[0] for b in both))
                cpu["ort"].append(max(b[1] for b in both))
                for key, value in (
                    ("single", single_cpu),
                    ("s0", s0_cpu),
                    ("s1", s1_cpu),
                    ("ort_single", ort_single_cpu),
                ):
                    cpu[key].append(value)
                for key, value in (
                    ("single", single),
                    ("pipe", piped),
                    ("eval", bare),
                    ("gloo", comm),
                    ("s0", s0),
                    ("s1", s1),
                    ("ort_single", ort_single),
                    ("ort_pipe", ort_piped),
                ):
                    times[key].append(value)
        pipe.close()
        ort.close()
        if rank == 0:
            med = {key: median_ms(v) for key, v in times.items()}
            t0, t1 = med["s0"] / k, med["s1"] / k
            ideal = t0 + (k - 1) * max(t0, t1) + t1
            cmed = {key: median_ms(v) for key, v in cpu.items()}
            c0, c1 = cmed["s0"] / k, cmed["s1"] / k
            busiest = cmed["pipe"] / k  # CPU per micro-batch of the busier rank during the 2-rank run
            rows_out.append(
                {
                    **{key: cfg[key] for key in ("model", "micro", "chunks")},
                    "single_ms": med["single"],
                    "pipe_ms": med["pipe"],
                    "ratio": med["single"] / med["pipe"],
                    "stage0_ms": t0,
                    "stage1_ms": t1,
                    "ideal_ratio": med["single"] / ideal,
                    "gloo_ms_per_mb": med["gloo"] / k,
                    "sched_ms_per_mb": (med["eval"] - ideal) / k,
                    "ours_ms_per_call": med["pipe"] - med["eval"],
                    "cpu_single_ms": cmed["single"],
                    "cpu_overhead_ms_per_mb": busiest - max(c0, c1),
                    "free_cores_ratio": cmed["single"] / (c0 + (k - 1) * busiest + c1),
                    "ort_single_ms": med["ort_single"],
                    "ort_pipe_ms": med["ort_pipe"],
                    "ort_ratio": med["ort_single"] / med["ort_pipe"],
                    "ort_free_cores_ratio": cmed["ort_single"] / (cmed["ort"] * (k + 1) / k),
                    "runs": {key: [v * 1e3 for v in vals] for key, vals in times.items()},
                }
            )
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(rows_out, f)
    dist.destroy_process_group()


def _table(rows: Sequence[dict[str, Any]], load: str) -> Any:
    from rich.table import Table

    table = Table(title=f"2 gloo ranks (ScheduleGPipe, 1 thread each) vs 1 process 1 thread; load avg {load}")
    for col in (
        "model", "m", "k", "1 proc ms", "2 ranks ms", "ratio", "stage0", "stage1", "ideal", "gloo/mb",
        "sched/mb", "ours/call", "cpu ovh/mb", "2 free cores", "ort 1 proc", "ort 2 ranks", "ort ratio",
        "ort free cores",
    ):  # fmt: skip
        table.add_column(col, justify="right" if col != "model" else "left")
    for r in rows:
        ok = "green" if r["ratio"] >= TARGET else "red"
        table.add_row(
            r["model"],
            str(r["micro"]),
            str(r["chunks"]),
            f"{r['single_ms']:.1f}",
            f"{r['pipe_ms']:.1f}",
            f"[{ok}]{r['ratio']:.2f}[/{ok}]",
            f"{r['stage0_ms']:.2f}",
            f"{r['stage1_ms']:.2f}",
            f"{r['ideal_ratio']:.2f}",
            f"{r['gloo_ms_per_mb']:.3f}",
            f"{r['sched_ms_per_mb']:.3f}",
            f"{r['ours_ms_per_call']:.3f}",
            f"{r['cpu_overhead_ms_per_mb']:.3f}",
            f"{r['free_cores_ratio']:.2f}",
            f"{r['ort_single_ms']:.1f}",
            f"{r['ort_pipe_ms']:.1f}",
            f"{r['ort_ratio']:.2f}",
            f"{r['ort_free_cores_ratio']:.2f}",
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    import torch.multiprocessing as mp
    from rich.console import Console

    from placement.distributed import free_port

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--chunks", type=int, default=16, help="micro-batches per step (k)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--split", default="time", choices=["time", "even"], help="how the 2 devices are balanced"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    console = Console(width=160)
    with tempfile.TemporaryDirectory() as tmp:
        configs = []
        for name in args.models:
            for micro in args.micro_batches:
                configs.append(prepare(name, micro, args.chunks, Path(tmp), split=args.split))
                console.print(f"prepared {name} m={micro}")
        out = Path(tmp) / "rows.pkl"
        mp.start_processes(
            _worker, args=(2, free_port(), configs, args.repeats, str(out)), nprocs=2, start_method="spawn"
        )
        rows = pickle.loads(out.read_bytes())
    env = environment()
    load = " ".join(f"{v:.1f}" for v in env["load_average"] or [])
    console.print(environment_line(env), highlight=False)
    console.print(_table(rows, load))
    console.print(
        f"target: ratio >= {TARGET}. 'ideal' is the fill-drain bound from the measured stage times; "
        "gloo = transport per micro-batch, sched = torch schedule beyond compute per micro-batch, "
        "ours = DistributedPipeline.run over bare schedule.eval per call (ms). From CPU time (immune to "
        "waiting for a core): cpu ovh/mb = CPU per micro-batch of the busier rank beyond its stage's compute "
        "(schedule + gloo + ours), '2 free cores' = the ratio those CPU costs allow when each rank has "
        "a core. ort: one pl.Runner (1 thread) vs 2 DistributedRunner ranks (ONNX Runtime stage sessions, "
        "1 thread each, gloo), same micro-batches; 'ort free cores' = the ratio their CPU times allow."
    )
    record = {
        "environment": env,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }
    write_results(args.output, record, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
