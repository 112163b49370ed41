"""The sessions of ``benchmarks/gpu_diagnose.py``'s variants, and what the driver prepared.

:class:`Setup` reads the work folder the driver wrote (``setup.json``: the unplaced model, the
placed model's two stage models, the input); :func:`make_session` builds a session as
``pl.Runner`` builds a stage's (``placement.runtime.ort.sessions``), with extra provider or
session entries; :class:`Chain` runs two stage sessions chained by hand through IOBindings;
:func:`run_on_thread` runs a call on one long-lived thread. The variants
(:mod:`benchmarks.gpu_diagnose_variants`), the options (:mod:`benchmarks.gpu_diagnose_options`)
and the processes (:mod:`benchmarks.gpu_diagnose_procs`) all build on these.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

__all__ = ["Chain", "Setup", "bind_run", "device_of", "make_session", "other_session", "run_on_thread",
           "stage_sessions"]  # fmt: skip


@dataclass
class Setup:
    """What the driver prepared (``setup.json`` in the work folder)."""

    folder: Path
    device: str  # "cuda" or "cpu"
    input_name: str
    stage_inputs: list[list[str]]  # per stage, its input names
    stage_outputs: list[list[str]]
    sources: dict[str, str]  # stage-1 input -> the stage-0 output it copies

    @classmethod
    def load(cls, folder: Path) -> Setup:
        data = json.loads((folder / "setup.json").read_text())
        return cls(folder=folder, **data)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def path(self, name: str) -> str:
        return str(self.folder / name)

    def feed(self) -> np.ndarray:
        return np.load(self.folder / "input.npy")


def make_session(setup: Setup, path: str, *, provider: dict[str, str] | None = None,
             config: dict[str, str] | None = None, threads: int | None = None,
             profile: str | None = None) -> ort.InferenceSession:  # fmt: skip
    """A session as ``pl.Runner`` makes a stage's, with extra provider / session entries."""
    from placement.runtime.device_map import PhysicalDevice
    from placement.runtime.ort.sessions import cuda_provider_options, stage_options

    physical = PhysicalDevice("cuda", 0) if setup.cuda else PhysicalDevice("cpu")
    options = stage_options(physical, threads=threads)
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = profile
    if not setup.cuda:
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    cuda = {**cuda_provider_options(physical), **(provider or {})}
    return ort.InferenceSession(
        path, options, providers=[("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    )


def device_of(setup: Setup) -> tuple[str, int]:
    return ("cuda", 0) if setup.cuda else ("cpu", 0)


def bind_run(session: ort.InferenceSession, inputs: dict[str, Any], device: tuple[str, int]) -> list[Any]:
    """One run through an IOBinding: ``inputs`` are OrtValues, outputs stay on ``device``."""
    binding = session.io_binding()
    for name, value in inputs.items():
        binding.bind_ortvalue_input(name, value)
    for out in session.get_outputs():
        binding.bind_output(out.name, device[0], device[1])
    session.run_with_iobinding(binding)
    return binding.get_outputs()


class Chain:
    """Two stage sessions, the first's outputs bound as the second's inputs (no host copy)."""

    def __init__(self, setup: Setup, sessions: list[ort.InferenceSession]) -> None:
        self.setup, self.sessions, self.device = setup, sessions, device_of(setup)
        self.value = ort.OrtValue.ortvalue_from_numpy(setup.feed(), *self.device)

    def __call__(self) -> list[Any]:
        first = dict(
            zip(
                self.setup.stage_outputs[0],
                bind_run(self.sessions[0], {self.setup.input_name: self.value}, self.device),
            )
        )
        second = {name: first[self.setup.sources.get(name, name)] for name in self.setup.stage_inputs[1]}
        return bind_run(self.sessions[1], second, self.device)


def stage_sessions(setup: Setup, **kw: Any) -> list[ort.InferenceSession]:
    return [make_session(setup, setup.path(f"stage{i}.onnx"), **kw) for i in range(2)]


def other_session(setup: Setup, **kw: Any) -> ort.InferenceSession:
    """Another session of the unplaced model, run once (as a user's second model would be)."""
    other = make_session(setup, setup.path("single.onnx"), **kw)
    other.run(None, {setup.input_name: setup.feed()})
    return other


def run_on_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` called on one long-lived worker thread (the caller waits for each call)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diagnose-run")
    return lambda: pool.submit(fn).result()
