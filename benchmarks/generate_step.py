"""Benchmark: the Python cost of one decode step of ``pl.Generator``, per stage (target <= 30 us).

A decode step's time is the stage sessions' compute plus what the loop adds around them:
binding the caches and inputs, handing values between stages, the logits, choosing the
token, the next step's inputs. This times, for each contender, many decode steps one by
one (on the tiny Llama of ``benchmarks/generate.py``, batch 1 by default), the time spent
inside the stage sessions' native run call, and reports per step the median of
``(step - inside sessions) / stages``: the Python overhead per stage. Both are the calling
thread's CPU time, so the figure is little moved by machine load (another process taking
the core does not count; cold caches after a session's kernels do, as they would on a
quiet machine).

Contenders: ``ort folded`` (``device_map="cpu"``: one session), ``ort 2 dev`` (two emulated
devices, a session each) and ``ort loop`` (one plain ``InferenceSession`` in a Python loop,
numpy in and out, the presents fed back: what a user writes by hand); and ``ort folded, warm``:
the same decode steps with the session's run skipped, so that nothing evicts the loop's
objects from the caches between steps: the Python alone. The torch runtime's
step has no separate native call to subtract; ``benchmarks/generate.py`` times it whole.

Usage::

    python benchmarks/generate_step.py
    python benchmarks/generate_step.py --batch 8 --steps 400
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import placement as pl  # noqa: E402
from benchmarks.generate import PROMPT, _setup  # noqa: E402

__all__ = ["TARGET_US", "main", "step_overheads"]

#: The target: Python overhead of a decode step, per stage, in microseconds.
TARGET_US = 30.0


def _clock() -> float:
    """This thread's CPU time (seconds): what the loop itself costs, not the time other
    processes of a loaded machine take from it."""
    return time.thread_time_ns() * 1e-9


class _Timed:
    """A native session whose run calls add their time to ``spent``."""

    def __init__(self, inner: Any, spent: list[float]) -> None:
        self._inner, self._spent = inner, spent

    def run_with_iobinding(self, *args: Any) -> Any:
        start = _clock()
        try:
            return self._inner.run_with_iobinding(*args)
        finally:
            self._spent[0] += _clock() - start

    def run(self, *args: Any) -> Any:
        start = _clock()
        try:
            return self._inner.run(*args)
        finally:
            self._spent[0] += _clock() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _generator_steps(generator: pl.Generator, ids: np.ndarray, steps: int) -> tuple[list[float], int]:
    """Per decode step (seconds): total minus time inside the sessions; and the stage count."""
    from placement.generation.sampling import Sampler
    from placement.generation.sequences import Sequences

    spent = [0.0]
    sessions = {
        id(step.exec.session): step.exec.session
        for step in generator.decoder.runner.program.steps
        if hasattr(step, "exec")
    }
    for session in sessions.values():
        session._sess = _Timed(session._sess, spent)
    decoder = generator.decoder
    seqs = Sequences(ids, np.ones_like(ids), max_new_tokens=steps + 1, eos=(), pad=0, sampler=Sampler())
    (slot,) = generator._take_slots([ids.shape[0]], ids.shape[1] + steps + 1)
    seqs.advance(decoder.step(slot, seqs.prefill()))
    overheads = []
    for _ in range(steps):
        spent[0] = 0.0
        start = _clock()
        seqs.advance(decoder.step(slot, seqs.decode()))
        overheads.append(_clock() - start - spent[0])
    for session in sessions.values():
        session._sess = session._sess._inner
    return overheads, len(sessions)


class _Skipped(_Timed):
    """A native session whose run calls do nothing: what is left of a step is its Python alone,
    with warm caches (no kernels evict it)."""

    def run_with_iobinding(self, *args: Any) -> Any:
        return None


def _warm_steps(generator: pl.Generator, ids: np.ndarray, steps: int) -> list[float]:
    """Per decode step of a one-stage (folded) generator, the step's CPU time with the
    session's run skipped (the step only binds; its outputs are the last real ones)."""
    from placement.generation.sampling import Sampler
    from placement.generation.sequences import Sequences

    decoder = generator.decoder
    seqs = Sequences(ids, np.ones_like(ids), max_new_tokens=steps + 2, eos=(), pad=0, sampler=Sampler())
    (slot,) = generator._take_slots([ids.shape[0]], ids.shape[1] + steps + 2)
    seqs.advance(decoder.step(slot, seqs.prefill()))
    seqs.advance(decoder.step(slot, seqs.decode()))
    program = decoder.runner.program
    sessions = {id(s.exec.session): s.exec.session for s in program.steps if hasattr(s, "exec")}
    for session in sessions.values():
        session._sess = _Skipped(session._sess, [0.0])
    times = []
    try:
        for _ in range(steps):
            start = _clock()
            seqs.advance(decoder.step(slot, seqs.decode()))
            times.append(_clock() - start)
    finally:
        for session in sessions.values():
            session._sess = session._sess._inner
    return times


def _loop_steps(path: Path, ids: np.ndarray, steps: int) -> list[float]:
    """The same for one plain session in a hand-written loop (numpy in and out)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    spent = [0.0]
    session._sess = _Timed(session._sess, spent)
    outputs = [o.name for o in session.get_outputs()]
    batch = ids.shape[0]
    feeds: dict[str, Any] = {
        i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32)
        for i in session.get_inputs()
        if i.name.startswith("past_key_values")
    }
    mask = np.ones_like(ids)
    feeds.update(
        input_ids=ids, attention_mask=mask, position_ids=np.arange(ids.shape[1])[None].repeat(batch, 0)
    )
    overheads = []
    for step in range(steps + 1):
        spent[0] = 0.0
        start = _clock()
        result = session.run(None, feeds)
        token = result[0][:, -1].argmax(-1)[:, None].astype(np.int64)
        for name, value in zip(outputs[1:], result[1:]):
            feeds[name.replace("present", "past_key_values")] = value
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], 1)
        feeds.update(input_ids=token, attention_mask=mask, position_ids=np.full((batch, 1), PROMPT + step))
        if step:
            overheads.append(_clock() - start - spent[0])
    return overheads


def step_overheads(batch: int = 1, steps: int = 200) -> dict[str, dict[str, float]]:
    """Per contender: stages, and the median and 10th percentile Python overhead per stage (us)."""
    setup = _setup("tiny", batch)
    rows = {}
    for name, options in (("ort folded", {"device_map": "cpu"}), ("ort 2 dev", {"device_map": "auto"})):
        generator = pl.Generator(setup.placed, **options)
        _generator_steps(generator, setup.ids, 8)  # warm-up
        overheads, stages = _generator_steps(generator, setup.ids, steps)
        rows[name] = _row(overheads, stages)
        if stages == 1:
            rows[f"{name}, warm (run skipped)"] = _row(_warm_steps(generator, setup.ids, steps), 1)
    _loop_steps(setup.onnx_path, setup.ids, 8)
    rows["ort loop"] = _row(_loop_steps(setup.onnx_path, setup.ids, steps), 1)
    return rows


def _row(overheads: list[float], stages: int) -> dict[str, float]:
    per_stage = sorted(x / stages * 1e6 for x in overheads)
    return {
        "stages": stages,
        "median_us": round(statistics.median(per_stage), 1),
        "p10_us": round(per_stage[len(per_stage) // 10], 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    rows = step_overheads(args.batch, args.steps)
    print(f"decode step, Python overhead per stage (us), batch {args.batch}; target <= {TARGET_US:.0f}")
    print("contender | stages | median | p10")
    for name, row in rows.items():
        print(f"{name} | {row['stages']} | {row['median_us']:.1f} | {row['p10_us']:.1f}")
    print(f"load average {[round(x, 2) for x in os.getloadavg()]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
