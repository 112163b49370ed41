"""A stage on the host (a device without streams) that queues work on a GPU: the backward of its
copy from a GPU input copies the gradient back to that GPU on this thread's current stream there.
The GPU stage that reads it next must wait for that stream (an event), as the stream emulator
(:mod:`tests.runtime.torch.stream_emulator`) checks."""

from __future__ import annotations

import pytest
import torch

from placement.runtime.torch.stage_exec import signal, wait_for
from tests.runtime.torch.stream_emulator import StreamEmulator

CUDA0 = torch.device("cuda", 0)
HOST = torch.device("cpu")


def _host_stage_then_gpu_stage(signal_fn) -> StreamEmulator:
    emu = StreamEmulator()
    with emu:
        # the host stage's thread: a gradient copied to the GPU lands on its current stream there
        env = {"grad": emu.place(torch.ones(4), CUDA0) * 2}
        signal_fn(env, HOST)
        side = emu.new_stream(CUDA0)  # the GPU stage's own stream reads it
        with emu.on_stream(CUDA0, side):
            wait_for(env)
            emu.record_stream(env["grad"], side)
            (env["grad"] * 3).sum()
    return emu


def test_a_host_stage_signals_the_gpu_work_it_queued():
    emu = _host_stage_then_gpu_stage(signal)
    emu.check()
    assert emu.waits(CUDA0), "the GPU stage's stream waited for nothing"


def test_without_the_host_stages_event_the_read_is_a_race():
    """The emulator sees the defect this guards against: a host stage that records nothing."""
    emu = _host_stage_then_gpu_stage(lambda env, device: None)
    with pytest.raises(AssertionError, match="before any wait"):
        emu.check()


def test_a_host_stage_with_host_values_only_records_nothing():
    emu = StreamEmulator()
    with emu:
        env = {"x": torch.ones(2)}
        signal(env, HOST)
    assert "__event__" not in env
