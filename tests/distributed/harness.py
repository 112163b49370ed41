"""Start real rank processes on 127.0.0.1 (gloo) for the distributed tests, bounded by a timeout."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from placement.distributed import free_port


def spawn(fn: Callable[..., None], nprocs: int, *args: Any, timeout: float = 90.0) -> dict[int, int | None]:
    """Run ``fn(rank, nprocs, port, *args)`` in ``nprocs`` fresh processes; their exit codes.

    This process hosts the rendezvous store on ``port`` (as torchrun's agent does), so
    it outlives any rank. Fails the test (AssertionError) if the ranks are not all done
    within ``timeout`` seconds; every process is killed on the way out.
    """
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, nprocs, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(rank, nprocs, port, *args), daemon=True) for rank in range(nprocs)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        alive = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        assert not alive, f"ranks {alive} still running after {timeout} s"
        return {rank: proc.exitcode for rank, proc in enumerate(procs)}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        del store


def init(rank: int, world_size: int, port: int, *, timeout: float = 30.0) -> None:
    """Join a gloo process group on 127.0.0.1 (inside a spawned rank; the store is the parent's)."""
    import faulthandler
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    faulthandler.dump_traceback_later(timeout * 2, exit=True)  # a hung rank shows where, then ends
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )
