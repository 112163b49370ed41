"""What a pipeline of stages would take on N devices: bubbles, transfers, overlap.

The machines at hand often have one GPU, so what a plan gains on 2, 4 or 8 GPUs has
to be predicted from what one GPU measures. :func:`predict` takes per-stage times
(seconds for a whole batch, measured with every stage on one device: the runtime
benchmark's per-stage timing, :func:`placement.calibrate`'s ``Trial.measured_s``)
and a link model (:mod:`placement.planning.link_model`: ``"nvlink"``, ``"pcie"`` or
measured links), and simulates the schedule:

* each stage runs its micro-batches in the schedule's order (``"gpipe"``: every
  forward, then every backward; ``"1f1b"``: ``N - j - 1`` warm-up forwards on stage
  ``j``, then one forward and one backward in turn); a micro-batch costs the stage
  ``time / chunks`` plus a fixed ``call_overhead_s`` per stage call (the launch and
  bookkeeping a smaller call does not shrink);
* with ``chunks > 1`` every micro-batch also pays the schedule's *fixed cost* on every
  stage, ``fixed_cost_s`` (the hand-offs between worker threads, splitting and joining,
  the Python around each call), as host work that the stages do one at a time (their
  Python holds one lock, the GIL): a stage call waits for the host, holds it for the
  fixed cost, then computes. In training the fixed cost is shared equally by a
  micro-batch's forward and backward. :func:`predict`'s default is
  :data:`FIXED_COST_S`, measured by ``benchmarks/pipeline.py --fixed-cost``;
* the blobs crossing boundary ``j`` (``Plan.cut_bytes``) move over the link from
  device ``j`` to ``j + 1`` as ``latency + bytes / chunks / bandwidth`` per micro-batch
  (gradients move back over the other direction); with ``overlap=True`` (copies on
  their own engine or stream, as both runtimes do on GPUs) a transfer delays only
  its reader and transfers over one link queue behind each other; with
  ``overlap=False`` the sending stage waits for its copy;
* a stage starts an item once its input has arrived and its previous item ended
  (list scheduling on the fixed per-stage order: exact for these schedules).

The simulation gives the step time of one batch (fill and drain included), the
steady-state time per batch when batches stream back to back (inference: the
slowest stage or link), the idle share (the *bubble*; for equal stages without
transfers it is GPipe's ``(N - 1) / (k + N - 1)``, the same for 1F1B) and the
speed-up over the same work on one device (the stage times summed, no transfers).

What it leaves out, said plainly: a micro-batch ``k`` times smaller rarely runs ``k``
times faster on a GPU (pass the measured per-call cost as ``call_overhead_s``, or
measure the stages at the micro-batch size and pass ``chunks=1``-equivalent times);
two stages sharing a link with other traffic; blobs that skip a stage are charged
on every boundary they cross.

Example:
    >>> from placement.planning.predict import simulate_pipeline
    >>> p = simulate_pipeline([1.0, 1.0], transfer_times=[0.0], chunks=4)
    >>> round(p.step_s, 3), round(p.bubble, 3)  # (4 + 2 - 1) ticks of 0.25 s
    (1.25, 0.2)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from placement.errors import PlanError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.planning.link_model import Link, Links, LinksLike, resolve_links
from placement.planning.plan import Plan

__all__ = ["FIXED_COST_S", "SCHEDULES", "Prediction", "predict", "simulate_pipeline"]

log = logging.getLogger(__name__)

#: The schedules :func:`simulate_pipeline` knows.
SCHEDULES = ("gpipe", "1f1b")

StageTimes = Union[Sequence[float], Mapping[int, Sequence[float]]]

#: The pipeline schedule's fixed cost per micro-batch per stage, in seconds, by runtime:
#: ``"ort"`` (``Runner(chunks=k).run``) and ``"torch"`` (``train_step`` on
#: ``to_torch(chunks=k)``, 1F1B, ``checkpoint="never"``, ``executor="auto"``: on these tiny
#: stages one thread runs them all). Medians over 2, 4 and 8 stages of ``Linear(8, 8)``
#: layers (near-zero compute, 16 micro-batches of 4 rows against the batch unsplit, one
#: intra-op thread, each logical device emulated on the CPU) from
#: ``benchmarks/pipeline.py --fixed-cost`` on a 2-core x86 CPU: ORT's on a machine shared with
#: other work (load average 12), torch's on an idle one (load average 1); the process CPU
#: time, which is the wall time where the process has the cores it uses. Torch's figure is
#: mostly torch's own cost per op of tiny ops (the same micro-batches run eagerly, with no
#: schedule, cost 70-230 us of it). :func:`predict` uses them when ``fixed_cost_s`` is not
#: given; a GPU machine's own figure (``benchmarks/results/pipeline_fixed_cost.json``,
#: ``summary``) is better there.
FIXED_COST_S = {"ort": 50e-6, "torch": 240e-6}


@dataclass(frozen=True)
class Prediction:
    """One predicted pipeline.

    Attributes:
        gpus: devices (stages) in the pipeline.
        chunks: micro-batches per batch.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        training: whether backward passes were simulated.
        stage_s: per stage, its whole-batch forward time (seconds).
        backward_s: per stage, its whole-batch backward time (empty for inference).
        transfer_s: per boundary, the time of one micro-batch's transfer over its link.
        step_s: one batch through the pipeline, fill and drain included.
        stream_s: per batch when batches stream back to back (the slowest stage or,
            overlapped, link; a training step cannot stream: equal to ``step_s``).
        single_s: the same work on one device, stages one after another, no transfers.
        bubble: idle share of the stages' time during a step.
        link: the link model, in words.
    """

    gpus: int
    chunks: int
    schedule: str
    training: bool
    stage_s: list[float]
    backward_s: list[float]
    transfer_s: list[float]
    step_s: float
    stream_s: float
    single_s: float
    bubble: float
    link: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Batches per second of a step (``1 / step_s``)."""
        return 1.0 / self.step_s if self.step_s > 0 else math.inf

    @property
    def speedup(self) -> float:
        """``single_s / step_s``: a step's speed-up over one device."""
        return self.single_s / self.step_s if self.step_s > 0 else math.inf

    @property
    def stream_speedup(self) -> float:
        """``single_s / stream_s``: the speed-up of a stream of batches over one device."""
        return self.single_s / self.stream_s if self.stream_s > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the properties included)."""
        data = dict(vars(self))
        data.update(throughput=self.throughput, speedup=self.speedup, stream_speedup=self.stream_speedup)
        return data


def simulate_pipeline(
    stage_times: Sequence[float],
    *,
    transfer_times: Sequence[float] | None = None,
    chunks: int = 1,
    schedule: str = "gpipe",
    backward_times: Sequence[float] | None = None,
    overlap: bool = True,
    call_overhead_s: float = 0.0,
    fixed_cost_s: float = 0.0,
    shared_device: bool = False,
    link: str = "",
) -> Prediction:
    """Simulate one batch through a pipeline of stages (see the module docstring).

    Args:
        stage_times: per stage, seconds of forward for the whole batch.
        transfer_times: per boundary (``len(stage_times) - 1``), seconds to move one
            micro-batch's blobs to the next stage (default: free).
        chunks: micro-batches per batch.
        schedule: ``"gpipe"`` or ``"1f1b"`` (the same order for inference).
        backward_times: per stage, seconds of backward for the whole batch: a
            training step (None: inference).
        overlap: transfers run beside compute (True) or hold the sending stage.
        call_overhead_s: fixed seconds per stage call, paid by every micro-batch.
        fixed_cost_s: with ``chunks > 1``, the schedule's seconds per micro-batch per
            stage, host work the stages do one at a time (see the module docstring).
        shared_device: every stage on one device (logical stages sharing a GPU): their
            compute runs one item at a time, while host work overlaps it.
        link: a description of the link model (kept in the result).

    Raises:
        PlanError: empty or negative times, mismatched lengths, an unknown schedule.

    Example:
        >>> p = simulate_pipeline([2.0, 2.0], transfer_times=[0.0], chunks=2, backward_times=[4.0, 4.0])
        >>> p.step_s  # (2 + 2 - 1) * (1 + 2)
        9.0
        >>> q = simulate_pipeline([0.0, 0.0], chunks=4, fixed_cost_s=0.001)  # no compute: 4 x 2 host slots
        >>> round(q.step_s, 9)
        0.008
    """
    n = len(stage_times)
    if n < 1:
        raise PlanError("a pipeline needs at least one stage time")
    if not isinstance(chunks, int) or chunks < 1:
        raise PlanError(f"chunks must be a positive integer, got {chunks!r}")
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    transfers = [0.0] * (n - 1) if transfer_times is None else [float(t) for t in transfer_times]
    if len(transfers) != n - 1:
        raise PlanError(f"{n} stages need {n - 1} transfer times, got {len(transfers)}")
    fwd = [float(t) for t in stage_times]
    bwd = [float(t) for t in backward_times] if backward_times is not None else []
    if backward_times is not None and len(bwd) != n:
        raise PlanError(f"{n} stages need {n} backward times, got {len(bwd)}")
    for what, values in (("stage", fwd), ("transfer", transfers), ("backward", bwd)):
        if any(not math.isfinite(t) or t < 0 for t in values):
            raise PlanError(f"{what} times must be finite and non-negative, got {values}")
    for what, value in (("call_overhead_s", call_overhead_s), ("fixed_cost_s", fixed_cost_s)):
        if not math.isfinite(value) or value < 0:
            raise PlanError(f"{what} must be non-negative, got {value!r}")
    training = backward_times is not None
    host = (fixed_cost_s / (2 if training else 1)) if chunks > 1 else 0.0  # per item, one at a time
    f = [t / chunks + call_overhead_s for t in fwd]
    b = [t / chunks + call_overhead_s for t in bwd]
    step, busy = _makespan(f, b, transfers, chunks, schedule, overlap, training, host, shared_device)
    single = sum(fwd) + sum(bwd)
    if training:
        stream = step
    elif shared_device:
        stream = max(sum(f), n * host) * chunks
    elif overlap:
        stream = max(max(f) + host, max(transfers, default=0.0), n * host) * chunks
    else:
        stream = max(f[j] + host + (transfers[j] if j < n - 1 else 0.0) for j in range(n))
        stream = max(stream, n * host) * chunks
    bubble = 1.0 - sum(busy) / (n * step) if step > 0 else 0.0
    return Prediction(
        gpus=n,
        chunks=chunks,
        schedule=schedule,
        training=training,
        stage_s=fwd,
        backward_s=bwd,
        transfer_s=transfers,
        step_s=step,
        stream_s=stream,
        single_s=single,
        bubble=max(0.0, bubble),
        link=link,
        extra={"fixed_cost_s": fixed_cost_s if chunks > 1 else 0.0},
    )


def _order(stage: int, n: int, chunks: int, schedule: str, training: bool) -> list[tuple[str, int]]:
    """The items stage ``stage`` of ``n`` runs, in order: ``("F", i)`` / ``("B", i)``."""
    forwards = [("F", i) for i in range(chunks)]
    if not training:
        return forwards
    backwards = [("B", i) for i in range(chunks)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(n - stage - 1, chunks)
    order = forwards[:warmup]
    for i in range(warmup, chunks):
        order += [("F", i), ("B", i - warmup)]
    return order + backwards[chunks - warmup :]


def _makespan(
    f: list[float],
    b: list[float],
    transfers: list[float],
    chunks: int,
    schedule: str,
    overlap: bool,
    training: bool,
    host: float = 0.0,
    shared_device: bool = False,
) -> tuple[float, list[float]]:
    """(time of the last item's end, per stage its busy time): list scheduling of each
    stage's fixed order, the item that can start earliest first; an item starts when its
    input arrived, its stage is free and (``host > 0``) the host is free, holds the host
    for ``host`` seconds, then computes (``shared_device``: once the one device is free)."""
    n = len(f)
    orders = [_order(j, n, chunks, schedule, training) for j in range(n)]
    position = [0] * n
    free = [0.0] * n
    busy = [0.0] * n
    host_free = device_free = 0.0
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, stage) -> end
    arrive: dict[tuple[str, int, int], float] = {}  # input of (kind, i, stage) is there at
    link_free: dict[tuple[int, int], float] = {}  # (from, to) -> when the link is free
    for _ in range(sum(len(o) for o in orders)):
        best: tuple[float, int] | None = None
        for j in range(n):
            if position[j] < len(orders[j]):
                ready = _ready(*orders[j][position[j]], j, n, done, arrive)
                if ready is not None and (best is None or max(free[j], ready) < best[0]):
                    best = (max(free[j], ready), j)
        if best is None:  # cannot happen for the schedules above; a guard against a bad order
            raise PlanError(f"the {schedule} schedule deadlocked in the simulation")
        start, j = best
        if host:
            start = max(start, host_free)
            host_free = start + host
        kind, i = orders[j][position[j]]
        compute = f[j] if kind == "F" else b[j]
        end = max(start + host, device_free if shared_device else 0.0) + compute
        device_free = end if shared_device else device_free
        busy[j] += host + compute
        done[(kind, i, j)] = end
        target = j + 1 if kind == "F" else j - 1
        if 0 <= target < n:
            delay = transfers[min(j, target)]
            if overlap:
                begin = max(end, link_free.get((j, target), 0.0))
                link_free[(j, target)] = begin + delay
                arrive[(kind, i, target)] = begin + delay
            else:
                end += delay
                arrive[(kind, i, target)] = end
        free[j] = end
        position[j] += 1
    return max(free), busy


def _ready(
    kind: str,
    i: int,
    j: int,
    n: int,
    done: dict[tuple[str, int, int], float],
    arrive: dict[tuple[str, int, int], float],
) -> float | None:
    """When item ``(kind, i)`` of stage ``j`` may start as far as its inputs go (None: not yet known)."""
    if kind == "F":
        return 0.0 if j == 0 else arrive.get(("F", i, j))
    if j == n - 1:  # the loss: right after the last stage's own forward
        return done.get(("F", i, j))
    came = arrive.get(("B", i, j))
    own = done.get(("F", i, j))
    return None if came is None or own is None else max(came, own)


# --- plans and models ---------------------------------------------------------------------


def predict(
    model_or_plan: Model | Plan,
    *,
    stage_times: StageTimes | None = None,
    links: LinksLike = "nvlink",
    gpus: int | Sequence[int] | None = None,
    chunks: int = 1,
    schedule: str = "gpipe",
    backward_times: StageTimes | None = None,
    overlap: bool = True,
    call_overhead_s: float = 0.0,
    fixed_cost_s: float | None = None,
    tensor_parallel: int | str | None = None,
    throughput: Mapping[str, float] | None = None,
) -> list[Prediction]:
    """Predict a plan's step time and throughput on N devices from measured stage times.

    Args:
        model_or_plan: a :class:`~placement.planning.plan.Plan` (its stages are its
            used devices, in order; boundary bytes from ``Plan.cut_bytes``), or a
            :class:`~placement.graph.Model`. For a model and ``gpus``, each count is
            planned with ``auto_place(copy, devices=N, links=links)`` (the model itself
            is not changed); without ``gpus``, the model's own placement is used (its
            devices in order of first use).
        stage_times: per stage, seconds of forward for the whole batch, measured with
            the stages on one device. For a plan (or a model's own placement): one
            time per stage. For a model with ``gpus``: a mapping ``{N: times}`` (each
            plan's own measured stages), or the times of the model's *own* placement,
            which scale each op's profiled cost by its stage's measured / profiled
            time before the N-way plans are made (as :func:`placement.calibrate` does).
            None: the plan's (or the profile's) op costs, in ns, as seconds.
        links: the link between consecutive devices: a preset (``"nvlink"``, ``"pcie"``),
            a :class:`~placement.planning.link_model.Link`, a :class:`Links` keyed by the
            plan's devices, or measured links (:func:`placement.measure_links`).
        gpus: device counts to predict for (a model only; a plan predicts for its own).
        chunks: micro-batches per batch.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        backward_times: like ``stage_times`` for the backward pass: predicts a training
            step (None: inference).
        overlap: whether transfers run beside compute (both runtimes copy on their own
            stream on GPUs).
        call_overhead_s: fixed seconds per stage call (measured per-call cost).
        fixed_cost_s: with ``chunks > 1``, the schedule's fixed cost per micro-batch per
            stage (host work done one stage at a time). None: :data:`FIXED_COST_S`,
            ``"torch"`` for a training step, ``"ort"`` otherwise (measured on a 2-core CPU;
            a GPU machine's own figure from ``benchmarks/pipeline.py --fixed-cost`` is better).
        tensor_parallel: for a model and ``gpus``: plan each count with tensor parallelism
            (:mod:`placement.planning.tp_planner`; ``"auto"`` weighs every divisor of the
            count, for one batch's time at ``chunks=1``, else a stream's). ``extra`` gets
            ``tensor_parallel`` and ``collective_s`` per stage, and ``groups``.
        throughput: for a model and ``gpus``: FLOP/s per device type (``{"cuda": 50e12}``):
            op times are FLOPs at that speed, not times measured here (None).

    Returns:
        One :class:`Prediction` per device count, in the order given.

    Raises:
        PlanError: times that do not match the stages, a plan whose costs are not
            times and no ``stage_times``, ``gpus`` given with a plan.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> plan = pl.auto_place(model.copy(), devices=2, cost="size", links=None)
        >>> (p,) = predict(plan, stage_times=[0.004, 0.006], links="pcie", chunks=4)
        >>> p.gpus, p.step_s > 0.006, round(p.single_s, 3)
        (2, True, 0.01)
    """
    link_model = resolve_links(links)
    if fixed_cost_s is None:
        fixed_cost_s = FIXED_COST_S["torch" if backward_times is not None else "ort"]
    overheads = (call_overhead_s, fixed_cost_s)
    if isinstance(model_or_plan, Plan):
        if gpus is not None:
            raise PlanError("predict: gpus= is for a model; a plan predicts for its own devices")
        if isinstance(stage_times, Mapping) or isinstance(backward_times, Mapping):
            raise PlanError("predict: a plan takes one time per stage, not a mapping")
        return [_predict_plan(model_or_plan, stage_times, backward_times, link_model, chunks, schedule,
                              overlap, overheads)]  # fmt: skip
    if not isinstance(model_or_plan, Model):
        raise PlanError(f"predict needs a placement.Model or a Plan, got {type(model_or_plan).__name__}")
    model = model_or_plan
    if gpus is None:
        plan = _own_plan(model, link_model, timed=stage_times is None)
        return [_predict_plan(plan, _times_for(stage_times, len(_used(plan)), "stage_times"),
                              _times_for(backward_times, len(_used(plan)), "backward_times"),
                              link_model, chunks, schedule, overlap, overheads)]  # fmt: skip
    counts = [gpus] if isinstance(gpus, int) else list(gpus)
    if not counts or any(not isinstance(c, int) or c < 1 for c in counts):
        raise PlanError(f"gpus must be positive device counts, got {gpus!r}")
    op_costs = None
    if stage_times is not None and not isinstance(stage_times, Mapping):
        op_costs = _scaled_op_costs(model, stage_times, link_model)
    if throughput is not None and op_costs is not None:
        raise PlanError("predict: throughput= (FLOPs at a speed) and measured stage_times exclude each other")
    results = []
    for count in counts:
        objective = "latency" if chunks == 1 and tensor_parallel else "throughput"  # one batch, or a stream
        plan = _plan_for(model, count, link_model, op_costs, tensor_parallel, throughput, objective)
        fwd = stage_times.get(count) if isinstance(stage_times, Mapping) else None
        back = backward_times.get(count) if isinstance(backward_times, Mapping) else None
        if backward_times is not None and not isinstance(backward_times, Mapping):
            back = _backward_scaled(plan, backward_times, stage_times)
        results.append(_predict_plan(plan, fwd, back, link_model, chunks, schedule, overlap, overheads))
    return results


def _times_for(times: StageTimes | None, count: int, what: str) -> Sequence[float] | None:
    if isinstance(times, Mapping):
        found = times.get(count)
        if found is None:
            raise PlanError(f"predict: {what} has no entry for {count} stages")
        return found
    return times


def _used(plan: Plan) -> list[Any]:
    """One row per stage: a used device, or a split stage's first device."""
    from placement.planning.tp_planner import stage_rows

    return stage_rows(plan)


def _predict_plan(
    plan: Plan,
    stage_times: Sequence[float] | None,
    backward_times: Sequence[float] | None,
    links: Links | None,
    chunks: int,
    schedule: str,
    overlap: bool,
    overheads: tuple[float, float],
) -> Prediction:
    """``overheads``: ``(call_overhead_s, fixed_cost_s)`` (see :func:`simulate_pipeline`)."""
    rows = _used(plan)
    if not rows:
        raise PlanError("the plan places no op")
    single = plan.total_cost * 1e-9 if plan.collectives and stage_times is None else None  # unsplit
    if stage_times is None:
        if plan.cost_kind != "time":
            raise PlanError(f"the plan's costs are {plan.cost_kind}, not times: pass stage_times=")
        stage_times = [(row.cost + row.cut_cost) * 1e-9 for row in rows]
    collective_s = [row.collective_time * 1e-9 for row in rows]  # split stages: added to their compute
    times = [float(t) + c for t, c in zip(stage_times, collective_s)]
    if len(times) != len(rows):
        raise PlanError(
            f"the plan has {len(rows)} stages ({', '.join(row.device for row in rows)}) "
            f"but {len(times)} stage times were given"
        )
    cut = list(plan.cut_bytes) + [0] * max(0, len(rows) - 1 - len(plan.cut_bytes))
    transfers = []
    described = ""
    for j in range(len(rows) - 1):
        link = _link(links, rows[j].device, rows[j + 1].device)
        nbytes = int(math.ceil(cut[j] / chunks))
        transfers.append(link.time_ns(nbytes) * 1e-9 if link is not None else 0.0)
        described = described or (str(link) if link is not None else "free")
    prediction = simulate_pipeline(
        times,
        transfer_times=transfers,
        chunks=chunks,
        schedule=schedule,
        backward_times=backward_times,
        overlap=overlap,
        call_overhead_s=overheads[0],
        fixed_cost_s=overheads[1],
        link=described,
    )
    prediction = prediction if single is None else dataclasses.replace(prediction, single_s=single)
    prediction.extra["cut_bytes"] = cut[: len(rows) - 1]
    prediction.extra["devices"] = [row.device for row in rows]
    if plan.tensor_parallel:
        prediction.extra["tensor_parallel"] = list(plan.tensor_parallel)
        prediction.extra["collective_s"] = collective_s
        prediction.extra["groups"] = [list(g) for g in plan.groups]
    return prediction


def _link(links: Links | None, src: str, dst: str) -> Link | None:
    return None if links is None else links.link(src, dst)


def _own_plan(model: Model, links: Links | None, *, timed: bool = True) -> Plan:
    """The model's own placement as a :class:`Plan` (op costs from its cached or a fresh
    profile, timed or, with ``timed=False``, counted in FLOPs; its devices in order of first use)."""
    from placement.planning.graph_info import GraphInfo
    from placement.planning.planner import evaluate_assignment
    from placement.planning.profile import profile

    prof = profile(model, time=timed, optimized=True)
    info = GraphInfo(model)
    devices: list[Device] = []
    part = []
    for node_name in info.names:
        device = model.op(node_name).device
        if device not in devices:
            devices.append(device)
        part.append(devices.index(device))
    return evaluate_assignment(
        info,
        prof.costs("time" if timed else "flops"),
        part,
        devices,
        [None] * len(devices),
        cost_kind="time" if timed else "flops",
        objective="throughput",
        fp=prof.fingerprint,
        links=links,
    )


def _plan_for(
    model: Model,
    count: int,
    links: Links | None,
    op_costs: Mapping[str, float] | None,
    tensor_parallel: int | str | None = None,
    throughput: Mapping[str, float] | None = None,
    objective: str = "throughput",
) -> Plan:
    from placement.planning.planner import auto_place, unapplied_plan

    work = model.copy()
    _unplace(work)
    if tensor_parallel is None and throughput is None:
        return auto_place(work, devices=count, links=links, op_costs=op_costs)
    options = dict(links=links, op_costs=op_costs, throughput=throughput, objective=objective)
    return unapplied_plan(work, count, tensor_parallel=tensor_parallel or 1, **options)


def _unplace(model: Model) -> None:
    """Every op of ``model`` (a private copy) on ``cuda:0``, as a fresh export."""
    first = Device("cuda", 0)
    for op in model.ops:
        model.set_device(op.name, first)


def _scaled_op_costs(model: Model, stage_times: Sequence[float], links: Links | None) -> dict[str, float]:
    """Op name -> cost in ns: each op's profiled cost scaled by its own stage's measured /
    profiled time (the model's own placement; stages in order of first use)."""
    plan = _own_plan(model, links)
    rows = _used(plan)
    if len(stage_times) != len(rows):
        raise PlanError(
            f"the model's own placement has {len(rows)} stages ({', '.join(r.device for r in rows)}) "
            f"but {len(stage_times)} stage times were given; pass {{N: times}} for other plans"
        )
    from placement.planning.profile import cached_profile

    prof = cached_profile(model, need_time=True)
    assert prof is not None  # _own_plan profiled it
    scale = {row.device: float(t) * 1e9 / row.cost if row.cost else 1.0 for row, t in zip(rows, stage_times)}
    costs = {}
    for name, op in prof.ops.items():
        device = plan.assignment.get(name)
        costs[name] = (op.time_s or 0.0) * 1e9 * scale.get(device or "", 1.0)
    return costs


def _backward_scaled(plan: Plan, backward_times: Any, stage_times: Any) -> list[float]:
    """Backward times of an N-way plan from the own placement's: the same backward / forward ratio."""
    ratio = sum(backward_times) / sum(stage_times) if stage_times and sum(stage_times) else 2.0
    return [(row.cost + row.cut_cost) * 1e-9 * ratio for row in _used(plan)]
