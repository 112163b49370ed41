"""The main job: place a built-in model across logical devices, run it on both runtimes, check it.

:func:`run_demo` builds a model from ``models/`` (the GPT-style decoder by
default), imports it with :func:`placement.from_torch`, splits its activations
into ``devices`` equal runs Caffe2 style (with 2 devices: the second half of the
activations shifted to device 1), injects cross-device copies, verifies the
placement, and then

* runs it through per-stage ONNX Runtime sessions (:class:`placement.Runner`),
* lowers it to a torch module (:func:`placement.to_torch`) and runs that,
* checks both against the original ``torch.nn.Module`` on the CPU, with the
  tolerance of the precision used (``precision="fp32"``, the default: TF32 off on
  GPUs, for ONNX Runtime's CUDA provider and for torch, compared within
  ``rtol=atol=1e-4``; ``"tf32"``: TF32 on, compared within the looser TF32
  tolerance; see :mod:`placement.runtime.precision`), and says which,
* prints the per-device table, the stages and the timings with ``rich``.

With fewer GPUs than logical devices, the logical devices share the GPUs there
are (``device_map="auto"``); with no GPU, every logical device is emulated on the
CPU (each stage in its own session): the runtime logs that once (a warning, on stderr
under the ``placement`` command) and the stage table marks the emulated devices.
Every runtime is warmed up before it is timed.

Example:
    >>> from rich.console import Console
    >>> result = run_demo("mlp", devices=2, console=Console(file=open("/dev/null", "w")))
    >>> result.ok, result.devices, len(result.stages) >= 2
    (True, 2, True)
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from placement.runtime.precision import Tolerance, check_precision, tolerance, torch_precision

__all__ = ["DemoResult", "RuntimeResult", "run_demo", "RTOL", "ATOL"]

log = logging.getLogger(__name__)

#: Tolerances for comparing runtime outputs with the original module in strict fp32
#: (:data:`placement.runtime.precision.FP32_TOLERANCE`; TF32 gets its own).
RTOL = 1e-4
ATOL = 1e-4


@dataclass
class RuntimeResult:
    """One runtime's outcome in the demo.

    Attributes:
        name: ``"torch eager (original)"``, ``"onnxruntime"`` or ``"torch lowered"``.
        build_s: seconds to build it (sessions / lowering); 0 for the original.
        run_ms: median latency of one run, in milliseconds.
        max_abs_diff: largest absolute difference from the original module's outputs.
        ok: outputs match the original within ``tolerance``.
        detail: a short note (stages, device map).
        error: the error message if the runtime failed.
        tolerance: what the outputs were compared with (precision, rtol, atol).
    """

    name: str
    build_s: float = 0.0
    run_ms: float = float("nan")
    max_abs_diff: float = 0.0
    ok: bool = True
    detail: str = ""
    error: str | None = None
    tolerance: Any = None


@dataclass
class DemoResult:
    """What :func:`run_demo` did and found.

    Attributes:
        model: model name; ``size``: ``"tiny"``/``"bench"``; ``devices``: logical devices.
        ops: ops in the placed model (copies included); ``copies``: copy ops.
        stages: ``(index, logical device, physical device, ops)`` per ORT stage.
        device_map: logical -> physical device, as strings.
        emulated: True when logical GPUs are emulated on the CPU.
        precision: ``"fp32"`` (TF32 off on GPUs) or ``"tf32"``.
        summary: the per-device report (:func:`placement.report.summary.summary`).
        runtimes: the original, ONNX Runtime and lowered torch results.
        ok: both runtimes match the original module.
    """

    model: str
    size: str
    devices: int
    ops: int = 0
    copies: int = 0
    stages: list[tuple[int, str, str, int]] = field(default_factory=list)
    device_map: dict[str, str] = field(default_factory=dict)
    emulated: bool = False
    precision: str = "fp32"
    summary: Any = None
    runtimes: list[RuntimeResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True if every runtime ran and matched the original module."""
        return bool(self.runtimes) and all(r.ok for r in self.runtimes)

    def runtime(self, name: str) -> RuntimeResult:
        """The result of the runtime whose name starts with ``name``."""
        return next(r for r in self.runtimes if r.name.startswith(name))


def run_demo(
    model_name: str | None = "gpt",
    size: str = "tiny",
    devices: int = 2,
    console: Any = None,
    *,
    repeats: int = 5,
    device_map: Any = "auto",
    precision: str = "fp32",
) -> DemoResult:
    """Place a built-in model on ``devices`` logical devices, run both runtimes, check, print.

    Args:
        model_name: a name from ``models.MODELS`` (None: the zoo's default, ``"gpt"``).
        size: ``"tiny"`` or ``"bench"``.
        devices: number of logical GPUs.
        console: a ``rich.console.Console`` to print to (default: a new one on stdout).
        repeats: timed runs per runtime (the median is reported).
        device_map: logical -> physical devices for both runtimes (default ``"auto"``).
        precision: ``"fp32"`` (TF32 off on GPUs, both runtimes) or ``"tf32"`` (TF32 on);
            decides the tolerance of the check (:func:`placement.runtime.precision.tolerance`).

    Returns:
        A :class:`DemoResult`; ``result.ok`` says whether both runtimes matched.

    Raises:
        PlanError: unknown model name or size, or ``devices < 1``.
    """
    import torch
    from rich.console import Console

    import placement as pl
    from placement import models

    console = console or Console()
    name = model_name or models.DEFAULT_MODEL
    if name not in models.MODELS:
        raise pl.PlanError(f"unknown model {name!r}; built-in models: {', '.join(sorted(models.MODELS))}")
    if size not in models.SIZES:
        raise pl.PlanError(f"unknown size {size!r}; choose from {', '.join(models.SIZES)}")
    check_precision(precision)
    result = DemoResult(model=name, size=size, devices=devices, precision=precision)

    net, args = models.build(name, size)
    with console.status(f"exporting {name} ({size}) to an operator graph..."):
        model = pl.from_torch(net, args)
    pl.place_evenly(model, devices)
    pl.verify(model)
    result.ops = len(model.ops)
    result.copies = sum(op.is_copy for op in model.ops)
    result.summary = pl.summary(model)

    with torch.no_grad():
        expected_out = net(*args)
    expected = [
        t.numpy() for t in (expected_out if isinstance(expected_out, (tuple, list)) else (expected_out,))
    ]
    feeds = [a.numpy() for a in args]

    eager = RuntimeResult("torch eager (original)", detail="the reference")
    with torch.no_grad():
        eager.run_ms = _median_ms(lambda: net(*args), repeats)
    result.runtimes.append(eager)

    # ONNX Runtime: one session per stage
    ort_result = RuntimeResult("onnxruntime")
    try:
        start = time.perf_counter()
        runner = pl.Runner(model, device_map=device_map, precision=precision)
        ort_result.build_s = time.perf_counter() - start
        outputs = runner.run(feeds)
        ort_result.tolerance = runner.tolerance
        ort_result.max_abs_diff, ort_result.ok = _compare(outputs, expected, runner.tolerance)
        ort_result.run_ms = _median_ms(lambda: runner.run(feeds), repeats)
        physical = runner.device_map
        result.device_map = {str(k): str(v) for k, v in sorted(physical.items())}
        result.emulated = any(p.emulated for p in physical.values())
        result.stages = [(s.index, str(s.device), str(physical[s.device]), len(s.ops)) for s in runner.stages]
        moves, copying = runner.program.n_handovers, runner.program.n_transfers  # emulated: none copy
        ort_result.detail = f"{len(result.stages)} sessions, {moves} transfers/run ({copying} copying)"
    except Exception as err:  # report, do not crash the demo
        log.debug("onnxruntime failed", exc_info=True)
        ort_result.ok, ort_result.error = False, f"{type(err).__name__}: {err}"
    result.runtimes.append(ort_result)

    # torch: the lowered fx module, parameters on their devices
    torch_result = RuntimeResult("torch lowered")
    try:
        start = time.perf_counter()
        module = pl.to_torch(model, device_map=device_map)
        torch_result.build_s = time.perf_counter() - start
        first = next(iter(module.device_map.values()), "cpu")
        inputs = tuple(a.to(first) for a in args)
        on_gpu = any(str(v).startswith("cuda") for v in module.device_map.values())
        torch_result.tolerance = tolerance(precision, on_gpu=on_gpu)
        with torch.no_grad(), torch_precision(precision):
            out = module(*inputs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            got = [t.detach().cpu().numpy() for t in outs]
            torch_result.max_abs_diff, torch_result.ok = _compare(got, expected, torch_result.tolerance)
            torch_result.run_ms = _median_ms(lambda: module(*inputs), repeats, sync=_sync(module))
        torch_result.detail = "pl.to_torch fx.GraphModule"
    except Exception as err:
        log.debug("torch lowering failed", exc_info=True)
        torch_result.ok, torch_result.error = False, f"{type(err).__name__}: {err}"
    result.runtimes.append(torch_result)

    _render(result, console)
    return result


# --- helpers -----------------------------------------------------------------------------


def _compare(got: list[np.ndarray], expected: list[np.ndarray], tol: Tolerance) -> tuple[float, bool]:
    if len(got) != len(expected):
        return float("inf"), False
    worst, ok = 0.0, True
    for a, b in zip(got, expected):
        if a.shape != b.shape:
            return float("inf"), False
        worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0)
        ok = ok and tol.allclose(a, b)
    return worst, ok


def _sync(module: Any) -> Callable[[], None]:
    import torch

    if any(str(v).startswith("cuda") for v in getattr(module, "device_map", {}).values()):
        return torch.cuda.synchronize
    return lambda: None


#: Warm-up before timing: at least this many calls and this many seconds (capped by ``_WARMUP_MAX``).
_WARMUP_CALLS, _WARMUP_S, _WARMUP_MAX = 3, 0.2, 200


def _warm_up(fn: Callable[[], Any], sync: Callable[[], None]) -> None:
    """Call ``fn`` until the first calls' one-off costs are paid: lazy initialisation, allocator
    growth, kernel selection, thread pools starting and pages faulted in. A fixed count is not
    enough on a cold machine (the first calls of a fresh process can take 100x a warm one), so
    it runs for at least ``_WARMUP_S`` seconds as well."""
    start = time.perf_counter()
    for calls in range(1, _WARMUP_MAX + 1):
        fn()
        sync()
        if calls >= _WARMUP_CALLS and time.perf_counter() - start >= _WARMUP_S:
            break


def _median_ms(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    _warm_up(fn, sync)
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _render(result: DemoResult, console: Any) -> None:
    from rich.table import Table

    console.rule(
        f"[bold]placement demo[/bold]: {result.model} ({result.size}) on {result.devices} logical devices"
    )
    if result.summary is not None:
        console.print(
            result.summary.to_table(title=f"placement by device ({result.ops} ops, {result.copies} copies)")
        )
    if result.stages:
        where = "; logical GPUs emulated on the CPU" if result.emulated else ""
        stages = Table(title=f"ONNX Runtime stages (one session each{where})")
        for column in ("stage", "logical device", "physical device", "ops"):
            stages.add_column(column, justify="right" if column in ("stage", "ops") else "left")
        for index, logical, physical, n_ops in result.stages:
            stages.add_row(
                str(index), logical, physical + (" (emulated)" if result.emulated else ""), str(n_ops)
            )
        console.print(stages)
    tolerances = sorted({str(r.tolerance) for r in result.runtimes if r.tolerance is not None})
    said = "; ".join(tolerances) or f"rtol={RTOL:g}, atol={ATOL:g}"
    timings = Table(title=f"runtimes vs the original module on the CPU ({said})")
    for column in ("runtime", "build", "latency (median)", "max |diff|", "match", "notes"):
        timings.add_column(column, justify="left" if column in ("runtime", "notes") else "right")
    for r in result.runtimes:
        match = "[green]yes[/]" if r.ok else "[red]NO[/]"
        timings.add_row(
            r.name,
            f"{r.build_s * 1e3:.0f} ms" if r.build_s else "-",
            f"{r.run_ms:.3f} ms" if r.run_ms == r.run_ms else "-",
            f"{r.max_abs_diff:.2e}" if r.error is None else "-",
            match,
            r.error or r.detail,
        )
    console.print(timings)
    for r in result.runtimes:
        if r.tolerance is not None:
            console.print(f"precision of {r.name}: {r.tolerance}")
    if result.ok:
        console.print("[bold green]OK[/]: both runtimes reproduce the original module's outputs.")
    else:
        console.print("[bold red]FAILED[/]: a runtime did not reproduce the original module's outputs.")
