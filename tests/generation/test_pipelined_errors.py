"""Pipelined generation (``chunks=2``, ONNX Runtime) when a worker fails: the caller gets a
PlacementError naming the failure, every worker thread ends, and the generator still works."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import placement as pl
from tests.generation.conftest import greedy_reference, left_padded

STEPS = 3


@pytest.mark.parametrize("worker", ["first", "last"])
def test_a_failing_worker_raises_in_the_caller_and_leaves_no_thread(causal_lm, worker: str) -> None:
    net, model = causal_lm("llama")
    pl.auto_place(model, devices=2, cost="flops")
    ids, mask = left_padded()
    ids, mask = np.concatenate([ids, ids[::-1]]), np.concatenate([mask, mask[::-1]])
    generator = pl.Generator(model, chunks=2)
    decoder = generator.decoder
    assert len(decoder.workers) >= 2
    failing = decoder.workers[0 if worker == "first" else -1][0]
    run_part, calls = decoder.run_part, []

    def broken(index, slot, values, new_tokens):
        if index == failing:
            calls.append(index)
            if len(calls) == 3:  # a decode step, after other groups are in flight
                raise RuntimeError("stage blew up")
        return run_part(index, slot, values, new_tokens)

    before = threading.active_count()
    decoder.run_part = broken
    with pytest.raises(pl.PlacementError, match="stage blew up"):
        generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS)
    assert threading.active_count() == before
    decoder.run_part = run_part
    out = generator.generate(ids, attention_mask=mask, max_new_tokens=STEPS)
    np.testing.assert_array_equal(out, greedy_reference(net, ids, mask, STEPS))
