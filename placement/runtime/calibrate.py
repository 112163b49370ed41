"""Calibration: plans balanced on *measured* stages, ONNX Runtime sessions or lowered torch stages.

``auto_place(model, devices=N)`` balances per-op times from one profiling run
(:func:`placement.profile`). On a loaded machine those times are noisy, and what a
stage session really costs also holds what no per-op time shows: its own call
overhead, the layout conversions at its boundaries, kernels fused differently at
its edges. :func:`calibrate` closes the loop on the real thing:

1. plan with ``auto_place(runtime="ort")`` (optimised-session op times, no cut
   inside a fused group);
2. build the plan's stage sessions as :class:`placement.Runner` builds them (its
   program: ``threads`` intra-op threads per stage, the stage session options,
   activations between convolutional CPU stages kept in ONNX Runtime's blocked
   layout) and time them on the inputs a run of the sample hands each, each stage
   alone, stages alternating round by round (the order reversed every other
   round), keeping each stage's median (on a shared machine whose other processes
   preempt most runs the median is far steadier than the fastest run);
3. scale the op costs of each part by its measured / predicted time and re-plan
   with those costs (``auto_place(op_costs=...)``); repeat for ``rounds`` rounds or
   until a plan repeats;
4. time every distinct plan met once more, all of them alternating in the same
   rounds (so load hits them alike), and keep the one with the smallest measured
   bottleneck (the slowest stage). The first plan is among them, so the result's
   measured bottleneck is never worse than the uncalibrated plan's in that
   comparison.

``runtime="torch"`` runs the same loop for ``pl.to_torch(model, chunks=k)``: the
plan is ``auto_place(runtime="torch")`` (ops timed one by one), and step 2 times
the lowered stages as the pipeline runs them
(:class:`placement.runtime.torch.timing.LoweredStages`: the ``torch.fx``
submodules of the pipeline's cut, warmed up into their TorchScript traces, with
``torch.set_num_threads(threads)`` while timing), forward alone or, with
``training=True``, forward and backward. Op-by-op ONNX Runtime times are a
proxy for torch kernels; without this loop a torch plan's cut moves with the
noise in them.

Costs: one ``auto_place`` per round (the profile is cached; each re-plan is the exact
planner on new costs) plus building and timing the stage sessions; a few seconds
for the zoo's bench models. The stage sessions of all plans met are held until the
end, so memory peaks at about ``rounds + 1`` copies of the weights' packed forms.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.runtime.calibrate import calibrate
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> result = calibrate(model, devices=2, rounds=1, repeats=3, device_map="cpu")
    >>> result.plan is result.trials[result.chosen].plan, result.plan.runtime
    (True, 'ort')
    >>> result.bottleneck_s <= result.trials[0].bottleneck_s
    True
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from placement.errors import PlanError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model
from placement.planning.dims import called_as, planned_dims
from placement.planning.frontend import transaction
from placement.planning.graph_info import GraphInfo
from placement.planning.plan import Plan
from placement.planning.planner import auto_place
from placement.planning.profile import _normalise_inputs, make_sample_inputs, profile
from placement.runtime.device_map import DeviceMapLike

if TYPE_CHECKING:
    from placement.runtime.torch.timing import LoweredStages

__all__ = ["Calibration", "Trial", "calibrate"]

log = logging.getLogger(__name__)


@dataclass
class Trial:
    """One plan met during calibration.

    Attributes:
        plan: the plan.
        predicted_s: per part (device, in plan order), the op costs the plan was made
            with, in seconds.
        measured_s: per part, its stage sessions' measured time in seconds, from the
            final comparison of all trials (:func:`calibrate`, step 4).
    """

    plan: Plan
    predicted_s: list[float]
    measured_s: list[float] = field(default_factory=list)

    @property
    def bottleneck_s(self) -> float:
        """The slowest part's measured time (what bounds pipelined throughput)."""
        return max(self.measured_s, default=0.0)

    @property
    def balance(self) -> float:
        """``sum / max`` of the measured part times: the best speed-up a pipeline of
        these stages can reach over running them one after another (N when even)."""
        top = self.bottleneck_s
        return sum(self.measured_s) / top if top > 0 else 1.0


@dataclass
class Calibration:
    """What :func:`calibrate` found.

    Attributes:
        plan: the chosen plan (applied to the model).
        trials: every distinct plan met, the uncalibrated one first.
        chosen: index of the chosen trial.
    """

    plan: Plan
    trials: list[Trial]
    chosen: int

    @property
    def bottleneck_s(self) -> float:
        """The chosen plan's measured bottleneck in seconds."""
        return self.trials[self.chosen].bottleneck_s

    def __str__(self) -> str:
        lines = []
        for k, t in enumerate(self.trials):
            mark = "*" if k == self.chosen else " "
            pred = " | ".join(f"{s * 1e3:.2f}" for s in t.predicted_s)
            meas = " | ".join(f"{s * 1e3:.2f}" for s in t.measured_s)
            lines.append(
                f"{mark} trial {k}: predicted {pred} ms, measured {meas} ms, balance {t.balance:.3f}"
            )
        return "\n".join(lines)


def calibrate(
    model: Model,
    devices: int | Sequence[DeviceLike] | None = None,
    max_memory: Mapping[Any, int | float | str] | None = None,
    *,
    sample_inputs: Any = None,
    rounds: int = 3,
    repeats: int = 11,
    threads: int = 1,
    device_map: DeviceMapLike = "auto",
    profile_repeats: int = 5,
    links: Any = "auto",
    fusion: bool = True,
    runtime: str = "ort",
    training: bool = False,
    batch: int | Mapping[str, int] | None = None,
) -> Calibration:
    """Plan for an executor, correcting the plan by timing its stages.

    See the module docstring for the loop. The chosen plan is applied to ``model`` in
    place (as ``auto_place`` does); its :class:`Plan` figures are the predictions it was
    made with (op costs scaled to measured stage times after the first round).

    Args:
        model: the model (no copies yet), placed in place.
        devices, max_memory: as for :func:`placement.auto_place`.
        sample_inputs: the inputs stages are profiled and timed on: one pipeline
            step's worth (a micro-batch for ``chunks=k``, a stream element for
            ``Runner.stream``); default :func:`placement.planning.profile.make_sample_inputs`
            at ``batch``.
        batch: the sizes of symbolic dimensions the sample inputs do not give, as for
            :func:`placement.auto_place` (default 1).
        rounds: re-plans at most (0: time the uncalibrated plan only).
        repeats: timed rounds per comparison (each stage's median is kept).
        threads: intra-op threads per stage session, as ``Runner(threads_per_stage=...)``;
            for ``runtime="torch"``, torch's intra-op threads while timing (``torch.set_num_threads``,
            restored afterwards).
        device_map: where the stages run, as for :class:`placement.Runner` or
            :func:`placement.to_torch`.
        profile_repeats: ``repeats`` of the initial profile.
        links, fusion: as for :func:`placement.auto_place`.
        runtime: ``"ort"`` (stage sessions, ``pl.Runner``) or ``"torch"`` (the lowered
            stages of ``pl.to_torch(chunks=k)``).
        training: with ``runtime="torch"``, time each stage's forward and backward
            (balance a training step) instead of its forward.

    Returns:
        A :class:`Calibration`: the chosen plan, every trial with its predicted and
        measured part times.

    Raises:
        PlanError: bad arguments (and whatever ``auto_place`` raises).
        PlacementError: a stage cannot be built or run (names the stage; for
            ``runtime="torch"``, a ``LoweringError`` naming the op types without a
            rule). On any error the model keeps the placement it had.
    """
    if rounds < 0 or repeats < 1 or threads < 1:
        raise PlanError(f"need rounds >= 0, repeats >= 1, threads >= 1; got {rounds}, {repeats}, {threads}")
    if runtime not in ("ort", "torch"):
        raise PlanError(f"calibrate times 'ort' (ONNX Runtime) or 'torch' (lowered) stages, not {runtime!r}")
    if training and runtime != "torch":
        raise PlanError("training=True times torch stages' backward: use it with runtime='torch'")
    with called_as("calibrate"):
        given = None if sample_inputs is None else _normalise_inputs(model, sample_inputs)
        dims = planned_dims(model, sample_inputs=given, batch=batch)
        feeds = make_sample_inputs(model, dims=dims) if given is None else given
    options: dict[str, Any] = dict(
        sample_inputs=feeds, repeats=profile_repeats, links=links, fusion=fusion, runtime=runtime, batch=dims
    )
    with transaction(model):  # a failure (a stage that cannot be built or run) restores the placement
        plan = auto_place(model, devices, max_memory, **options)
        if plan.cost_kind != "time":  # too large to time: nothing to calibrate
            return Calibration(plan=plan, trials=[Trial(plan, [0.0] * len(plan.devices))], chosen=0)
        with _torch_threads(threads if runtime == "torch" else None):
            return _calibrate(
                model, devices, max_memory, plan, feeds, options,
                rounds=rounds, repeats=repeats, threads=threads, device_map=device_map, training=training,
            )  # fmt: skip


def _calibrate(
    model: Model,
    devices: int | Sequence[DeviceLike] | None,
    max_memory: Mapping[Any, int | float | str] | None,
    plan: Plan,
    feeds: dict[str, np.ndarray],
    options: dict[str, Any],
    *,
    rounds: int,
    repeats: int,
    threads: int,
    device_map: DeviceMapLike,
    training: bool,
) -> Calibration:
    runtime = options["runtime"]
    info = GraphInfo(model)
    base = profile(model, sample_inputs=feeds, repeats=options["repeats"], optimized=runtime == "ort").costs(
        "time"
    )
    costs = {info.names[pos]: float(c) for pos, c in enumerate(base)}
    order = [Device.parse(d.device) for d in plan.devices]
    trials: list[Trial] = []
    timers: list[_StageTimer | LoweredStages] = []
    seen: dict[tuple[str, ...], int] = {}
    for r in range(rounds + 1):
        key = tuple(plan.assignment[name] for name in info.names)
        if key in seen:
            log.info("calibrate: round %d repeats trial %d; stopping", r, seen[key])
            break
        seen[key] = len(trials)
        trial = Trial(plan, [d.cost / 1e9 for d in plan.devices])
        timer: _StageTimer | LoweredStages
        if runtime == "torch":
            from placement.runtime.torch.timing import LoweredStages

            timer = LoweredStages(model, order, feeds, device_map=device_map, training=training)
        else:
            timer = _StageTimer(model, order, feeds, threads=threads, device_map=device_map)
        trials.append(trial)
        timers.append(timer)
        if r == rounds:
            break
        measured = _time_all([timer], repeats)[0]
        log.info(
            "calibrate: trial %d predicted %s ms, measured %s ms",
            len(trials) - 1,
            [round(p * 1e3, 2) for p in trial.predicted_s],
            [round(m * 1e3, 2) for m in measured],
        )
        for k, device in enumerate(order):
            predicted = trial.predicted_s[k]
            if predicted <= 0 or measured[k] <= 0:
                continue
            scale = measured[k] / predicted
            for name, dev in plan.assignment.items():
                if dev == str(device) and name in costs:
                    costs[name] *= scale
        plan = auto_place(model, devices, max_memory, op_costs=costs, **options)
    for trial, measured in zip(trials, _time_all(timers, repeats)):
        trial.measured_s = measured
    chosen = min(range(len(trials)), key=lambda k: (trials[k].bottleneck_s, k))
    best = trials[chosen].plan
    best.apply(model)
    log.info("calibrate: chose trial %d of %d\n%s", chosen, len(trials), Calibration(best, trials, chosen))
    return Calibration(plan=best, trials=trials, chosen=chosen)


class _StageTimer:
    """The stage sessions of the model's current placement as :class:`placement.Runner` runs
    them (its program: stage options, blocked boundaries between CPU stages), each runnable
    alone on the inputs a run of the sample hands it."""

    def __init__(
        self,
        model: Model,
        order: list[Device],
        inputs: dict[str, np.ndarray],
        *,
        threads: int,
        device_map: DeviceMapLike,
    ) -> None:
        from placement.runtime.ort import Runner
        from placement.runtime.ort.steps import HostStep, StageStep

        program = Runner(model, device_map=device_map, threads_per_stage=threads, fold=False).program
        values = program.feed([inputs[name] for name, _ in program.feeds])
        self.part_of: list[int] = []
        self.parts = len(order)
        self.runs: list[Callable[[], Any]] = []
        for step in program.steps:
            if not isinstance(step, (StageStep, HostStep)):  # a transfer
                step.run(values)
                continue
            feeds = step.inputs(values)
            step.store(values, step.call(feeds))  # also the warm-up run
            self.runs.append(functools.partial(step.call, feeds))
            self.part_of.append(order.index(step.exec.stage.device))


def _time_all(timers: Sequence[_StageTimer | LoweredStages], repeats: int) -> list[list[float]]:
    """Per timer, per part: the median of ``repeats`` rounds, every stage of
    every timer run alone once per round, the order reversed every other round."""
    runs = [(t, s) for t in range(len(timers)) for s in range(len(timers[t].runs))]
    samples: dict[tuple[int, int], list[float]] = {key: [] for key in runs}
    clock = time.perf_counter
    for r in range(repeats):
        for key in runs if r % 2 == 0 else reversed(runs):
            run = timers[key[0]].runs[key[1]]
            start = clock()
            run()
            samples[key].append(clock() - start)
    best = {key: statistics.median(values) for key, values in samples.items()}
    return [per_part(timer, [best[(t, s)] for s in range(len(timer.runs))]) for t, timer in enumerate(timers)]


def per_part(timer: _StageTimer | LoweredStages, stage_times: Sequence[float]) -> list[float]:
    """Per-stage times (in ``timer.runs`` order) summed into per-part times: ``timer.parts``
    parts, stage ``s`` in part ``timer.part_of[s]``.

    Example:
        >>> from types import SimpleNamespace
        >>> per_part(SimpleNamespace(part_of=[0, 1, 0], parts=2), [1.0, 2.0, 4.0])
        [5.0, 2.0]
    """
    totals = [0.0] * timer.parts
    for k, seconds in zip(timer.part_of, stage_times):
        totals[k] += seconds
    return totals


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for the block (``None``: untouched)."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
