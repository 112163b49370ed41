"""One process per stage, chained through shared memory: ``gpu_diagnose.py``'s ``processes`` variant.

Routing around several sessions in one process: stage ``i`` runs in its own process
(one session each, on the same device), activations cross through POSIX shared memory
(``multiprocessing.shared_memory``; on a GPU that is one device-to-host and one
host-to-device copy per boundary, which the other variants do not pay), and small
messages (names, shapes, dtypes) through pipes. The caller times input in to output
back, like every other variant.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.gpu_diagnose_sessions import Setup, make_session

__all__ = ["time_processes"]

Described = dict[str, tuple[str, tuple[int, ...], str]]  # blob -> (shared memory name, shape, dtype)


class _Arrays:
    """Arrays in shared memory: this process's own blocks (by blob) and attached peers' (by name)."""

    def __init__(self) -> None:
        self.own: dict[str, SharedMemory] = {}
        self.peers: dict[str, SharedMemory] = {}

    def put(self, blob: str, array: np.ndarray) -> tuple[str, tuple[int, ...], str]:
        block = self.own.get(blob)
        if block is None or block.size < array.nbytes:
            if block is not None:
                block.close()
                block.unlink()
            block = self.own[blob] = SharedMemory(create=True, size=max(1, array.nbytes))
        np.ndarray(array.shape, array.dtype, buffer=block.buf)[...] = array
        return block.name, tuple(array.shape), array.dtype.str

    def get(self, name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        block = self.peers.get(name)
        if block is None:
            block = self.peers[name] = SharedMemory(name=name)  # the owner unlinks it
        return np.ndarray(shape, np.dtype(dtype), buffer=block.buf)

    def close(self) -> None:
        for block in self.peers.values():
            block.close()
        for block in self.own.values():
            block.close()
            block.unlink()


def _worker(stage: int, folder: str, inbox: Connection, outbox: Connection, ready: Connection) -> None:
    """Stage ``stage``'s process: run each described input, describe the outputs onward."""
    setup = Setup.load(Path(folder))
    session = make_session(setup, setup.path(f"stage{stage}.onnx"))
    arrays = _Arrays()
    ready.send(stage)
    try:
        while (message := inbox.recv()) is not None:
            feeds = {}
            for name in setup.stage_inputs[stage]:
                feeds[name] = np.array(arrays.get(*message[setup.sources.get(name, name)]))
            outputs = session.run(setup.stage_outputs[stage], feeds)
            outbox.send({n: arrays.put(n, v) for n, v in zip(setup.stage_outputs[stage], outputs)})
        outbox.send(None)
    finally:
        arrays.close()


def time_processes(setup: Setup, *, warmup: int, repeats: int) -> dict[str, Any]:
    """Time the two-process chain; ``build_s`` until both processes built their session."""
    context = mp.get_context("fork")  # this process has not touched CUDA: forking is safe
    start = time.perf_counter()
    to_first, first_in = context.Pipe()  # the caller -> stage 0
    from_first, into_last = context.Pipe()  # stage 0 -> stage 1
    from_last, last_out = context.Pipe()  # stage 1 -> the caller
    ready_parent, ready_child = context.Pipe()
    procs = [
        context.Process(target=_worker, args=(0, str(setup.folder), first_in, from_first, ready_child)),
        context.Process(target=_worker, args=(1, str(setup.folder), into_last, from_last, ready_child)),
    ]
    for proc in procs:
        proc.start()
    arrays = _Arrays()
    try:
        for _ in procs:
            if not ready_parent.poll(600):
                raise TimeoutError("a stage process did not build its session")
            ready_parent.recv()
        built = time.perf_counter() - start
        message = {setup.input_name: arrays.put(setup.input_name, setup.feed())}
        spent = []
        for r in range(warmup + repeats):
            begin = time.perf_counter()
            to_first.send(message)
            out = last_out.recv()
            values = [arrays.get(*out[name]) for name in setup.stage_outputs[1]]
            if r >= warmup:
                spent.append((time.perf_counter() - begin) * 1e3)
        shapes = [list(v.shape) for v in values]
    finally:
        to_first.send(None)  # each stage passes the None on and stops
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        arrays.close()
    return {"build_s": round(built, 3), "run_ms": [round(s, 4) for s in spent],
            "median_ms": round(statistics.median(spent), 4), "output_shapes": shapes,
            "notes": ["activations through host shared memory"]}  # fmt: skip
