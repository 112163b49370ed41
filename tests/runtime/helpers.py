"""Shared by the pipelining tests: the zoo placed on two devices, and a check that no pipeline
thread outlives its test."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

import placement as pl


@pytest.fixture(autouse=True)
def no_thread_leak():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        extra = [t for t in set(threading.enumerate()) - before if t.name.startswith("placement-pipeline")]
        if not extra:
            return
        time.sleep(0.01)
    raise AssertionError(f"pipeline threads left running: {extra}")


@functools.cache
def placed_zoo(name: str):
    from placement import models

    net, args = models.build(name, "tiny")
    batch = torch.export.Dim("batch")
    model = pl.from_torch(net, args, dynamic_shapes=tuple({0: batch} for _ in args))
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    # A batch of 5 (not a multiple of the chunk counts used below).
    big = tuple(torch.cat([a, a.flip(0), a, a.flip(0), a])[:5] for a in args)
    return model, net, big
