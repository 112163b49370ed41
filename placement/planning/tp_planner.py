"""Choosing a tensor-parallel degree: ``auto_place(model, devices=N, tensor_parallel="auto" | k)``.

For each candidate degree ``t`` the planner makes a plan of ``N / t`` pipeline stages, each
stage split over a group of ``t`` devices, and keeps the best by the objective:

* ``t = 1`` is the ordinary plan (:func:`placement.auto_place` without tensor parallelism):
  ``N`` stages of one device.
* ``t = N``: one stage split over every device.
* ``1 < t < N`` (tensor inside pipeline, 2D): ``N / t`` stages, each split over its own group.
  The groups are consecutive devices (``[[0, 1], [2, 3]]``) or, where the links inside them
  would be faster that way, strided ones (``[[0, 2], [1, 3]]``): both layouts are weighed when
  the link model does not treat every pair of devices alike.
* ``t > 1``: each op costs its unsplit cost times its share at degree ``t``, and the
  collectives after an op cost their copies over the links inside the stage's group and
  their fixed latency (:mod:`placement.planning.tp_cost`, read from the graph the pass makes
  over one group and priced on each group's links). The stages are cut from these costs with
  the exact partition of :mod:`placement.planning.partition` (each op charged the slowest
  group's collectives; one stage: nothing to cut), each stage on the first device of its
  group.
* ``"throughput"`` compares bottlenecks (a stream of batches, pipelined); ``"latency"``
  compares one request's time through every stage. Pipelining cannot cut one request's time,
  so tensor parallelism wins the latency objective whenever the compute it splits outweighs
  its collectives, and rarely the throughput objective (only where no pipeline balances, say
  one layer bigger than the rest together, or where no pipeline fits the memory budgets).

``"auto"`` weighs every divisor of ``N`` that the pass can split the model over and keeps the
best (ties: the smaller degree); an int applies that degree. Applying the plan places each
stage's ops on the first device of its group and calls :func:`placement.split_tensor_parallel`
with the groups (one group: a plain split; several: the 2D split). Every stage has the same
degree: per-stage degrees (``[[0, 1], [2]]``) are not weighed, since the pass takes groups of
one size only.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> plan = pl.auto_place(model, devices=2, tensor_parallel=2, cost="flops", links="nvlink")
    >>> plan.tensor_parallel, plan.groups, plan.collectives
    ([2], [['cuda:0', 'cuda:1']], 2)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from placement.errors import InfeasiblePlacementError, InputError, PlanError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.sizes import format_bytes
from placement.planning.evaluate import build_plan
from placement.planning.graph_info import GraphInfo
from placement.planning.link_model import Links
from placement.planning.partition import PartitionProblem
from placement.planning.plan import DevicePlan, Plan
from placement.planning.tp_cost import COLLECTIVE_LATENCY_S, SplitCost, analyse_split

__all__ = [
    "candidate_degrees",
    "check_tensor_parallel",
    "flops_as_ns",
    "layouts",
    "objective_ns",
    "plan_tensor_parallel",
    "stage_rows",
]

log = logging.getLogger(__name__)


def candidate_degrees(devices: int, tensor_parallel: Any) -> list[int]:
    """The degrees to weigh for ``tensor_parallel`` on ``devices`` devices.

    Raises:
        PlanError: not ``"auto"`` or a positive int dividing the device count.

    Example:
        >>> candidate_degrees(8, "auto"), candidate_degrees(8, 2)
        ([1, 2, 4, 8], [2])
    """
    if tensor_parallel == "auto":
        return [t for t in range(1, devices + 1) if devices % t == 0]
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int):
        raise PlanError(f"tensor_parallel must be 'auto' or a degree (an int), got {tensor_parallel!r}")
    if tensor_parallel < 1 or devices % tensor_parallel:
        raise PlanError(
            f"tensor_parallel={tensor_parallel} must be a positive divisor of the device count {devices}"
        )
    return [tensor_parallel]


def layouts(devices: Sequence[Device], t: int, links: Links | None) -> list[list[list[Device]]]:
    """The ways to group ``devices`` into stages of ``t`` devices that are weighed: consecutive
    devices, and strided ones where ``links`` does not treat every pair alike (with several
    stages of several devices each).

    Example:
        >>> from placement.planning.link_model import Links
        >>> gpus = [Device("cuda", k) for k in range(4)]
        >>> fast = Links({(0, 2): "nvlink", (1, 3): "nvlink"}, default="pcie")
        >>> [[[d.index for d in g] for g in groups] for groups in layouts(gpus, 2, fast)]
        [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]
        >>> len(layouts(gpus, 2, Links(default="nvlink")))
        1
    """
    count = len(devices)
    blocked = [list(devices[i : i + t]) for i in range(0, count, t)]
    if not 1 < t < count or links is None:
        return [blocked]
    pairs = {links.link(a, b) for a in devices for b in devices if a != b}
    if len(pairs) <= 1:
        return [blocked]
    stages = count // t
    return [blocked, [list(devices[j::stages]) for j in range(stages)]]


def stage_rows(plan: Plan) -> list[DevicePlan]:
    """One row per pipeline stage of ``plan`` (a split stage's first device), in order."""
    if plan.groups:
        firsts = [group[0] for group in plan.groups]
        by_device = {row.device: row for row in plan.devices}
        return [by_device[d] for d in firsts if d in by_device]
    return [row for row in plan.devices if row.ops]


def objective_ns(plan: Plan, objective: str) -> int:
    """The figure a degree is chosen by: the bottleneck stage (``"throughput"``) or the
    stages one after another (``"latency"``: one request's time)."""
    costs = [row.stage_cost for row in stage_rows(plan)]
    return max(costs, default=0) if objective == "throughput" else sum(costs)


def plan_tensor_parallel(
    model: Model,
    info: GraphInfo,
    costs: Sequence[int],
    devices: Sequence[Device],
    tensor_parallel: Any,
    *,
    pipeline: Callable[[], Plan],
    objective: str,
    links: Links | None,
    allowed: Sequence[bool] | None = None,
    dims: Mapping[str, int] | None = None,
    fp: str = "",
    latency_s: float = COLLECTIVE_LATENCY_S,
    budgets: Sequence[int | None] | None = None,
) -> Plan:
    """The best plan over the candidate degrees (see the module docstring); not applied.

    Args:
        model: the unsplit model (not changed).
        info: its graph tables.
        costs: per op, its unsplit time in ns.
        devices: the devices, in pipeline order.
        tensor_parallel: ``"auto"`` or a degree.
        pipeline: makes the ordinary (degree 1) plan on the same costs.
        objective: ``"throughput"`` or ``"latency"``.
        links: the link model copies and collectives are charged on.
        allowed: where a stage may end (``n + 1`` flags), as the planner allows cuts.
        dims: sizes of symbolic dimensions.
        fp: the model's fingerprint.
        latency_s: the fixed cost of each collective.
        budgets: per device, its memory budget in bytes or None. A split device holds its
            shards and the replicated parameters (counted from the split graph) plus the
            stage's peak activations unsplit (an upper bound: sharded activations are smaller).

    Raises:
        PlanError: a bad ``tensor_parallel``.
        InputError: (an int) a model the pass cannot split over the degree.
        InfeasiblePlacementError: no degree weighed fits the budgets (the message says why).
    """
    degrees = candidate_degrees(len(devices), tensor_parallel)
    plans: dict[int, Plan] = {}
    reasons: list[str] = []
    for t in degrees:
        try:
            if t == 1:
                plans[t] = _unsplit(pipeline())
                continue
            plans[t] = _split_plan(
                model,
                info,
                costs,
                devices,
                t,
                objective=objective,
                links=links,
                allowed=allowed,
                dims=dims,
                fp=fp,
                latency_s=latency_s,
            )
            _check_budgets(plans[t], devices, budgets)
        except (InputError, InfeasiblePlacementError) as err:
            if tensor_parallel != "auto":
                raise
            plans.pop(t, None)
            reasons.append(f"degree {t}: {err}")
            log.info("tensor_parallel='auto': degree %d is out: %s", t, err)
    if not plans:
        raise InfeasiblePlacementError("no tensor-parallel degree fits: " + "; ".join(reasons))
    scores = {t: objective_ns(p, objective) for t, p in plans.items()}
    best = min(scores, key=lambda t: (scores[t], t))
    plan = plans[best]
    if len(degrees) > 1:
        plan.tp_choices = {str(t): scores[t] for t in sorted(scores)}
    log.info(
        "tensor parallel degree %d chosen (%s)", best, ", ".join(f"{t}: {s} ns" for t, s in scores.items())
    )
    return plan


def check_tensor_parallel(cost: str, offload: bool | None) -> None:
    """Options that do not combine with ``tensor_parallel=``."""
    if cost == "size":
        raise PlanError("tensor_parallel= weighs times: use cost='time' or cost='flops' (at device speeds)")
    if offload:
        raise PlanError("tensor_parallel= does not combine with offload=True")


def flops_as_ns(flops: Sequence[int], device: Device, throughput: Mapping[str, float] | None) -> list[int]:
    """FLOPs as nanoseconds at ``device``'s speed (given, measured here, or the default)."""
    from placement.planning.speeds import device_speeds

    rate = device_speeds(throughput, gpu_index=device.index or 0).rates.get(device.type)
    if rate is None:
        raise PlanError(f"no speed is known for device type {device.type!r}: pass throughput=")
    log.info("auto_place: FLOPs as times at %.3g TFLOP/s on %s", rate / 1e12, device.type)
    return [round(f * 1e9 / rate) for f in flops]


def _check_budgets(plan: Plan, devices: Sequence[Device], budgets: Sequence[int | None] | None) -> None:
    """Give a split plan's rows their budgets; raise where one does not fit."""
    if budgets is None or not plan.groups or all(len(g) == 1 for g in plan.groups):
        return  # a degree-1 plan was planned under the budgets already
    index = {str(d): k for k, d in enumerate(devices)}
    for row in plan.devices:
        row.budget = budgets[index[row.device]]
        if not row.fits:
            raise InfeasiblePlacementError(
                f"split over {plan.groups[0]}, {row.device} needs {format_bytes(row.memory)} "
                f"(parameters {format_bytes(row.param_bytes)}, peak activations "
                f"{format_bytes(row.activation_bytes)}) against a budget of {format_bytes(row.budget or 0)}"
            )


def _unsplit(plan: Plan) -> Plan:
    """A degree-1 plan, saying so: every used device is a stage of its own."""
    plan.groups = [[row.device] for row in plan.devices if row.ops]
    plan.tensor_parallel = [1] * len(plan.groups)
    return plan


def _split_plan(
    model: Model,
    info: GraphInfo,
    costs: Sequence[int],
    devices: Sequence[Device],
    t: int,
    *,
    objective: str,
    links: Links | None,
    allowed: Sequence[bool] | None,
    dims: Mapping[str, int] | None,
    fp: str,
    latency_s: float,
) -> Plan:
    """``len(devices) / t`` stages, each split over a group of ``t`` devices: the best of the
    :func:`layouts` (ties: consecutive groups)."""
    split = analyse_split(model, info, list(devices[:t]), links=links, dims=dims, latency_s=latency_s)
    best: Plan | None = None
    for groups in layouts(devices, t, links):
        plan = _layout_plan(
            split, info, costs, groups, objective=objective, links=links, allowed=allowed, fp=fp
        )
        if best is None or objective_ns(plan, objective) < objective_ns(best, objective):
            best = plan
    assert best is not None
    return best


def _layout_plan(
    split: SplitCost,
    info: GraphInfo,
    costs: Sequence[int],
    groups: list[list[Device]],
    *,
    objective: str,
    links: Links | None,
    allowed: Sequence[bool] | None,
    fp: str,
) -> Plan:
    """The plan of stages split over ``groups``, each stage on its group's first device."""
    n = len(info)
    per_group = [split.on(g, links).collective_ns(n) for g in groups]
    coll = [max(c[i] for c in per_group) for i in range(n)]  # a cut cannot know the group yet
    received = split.received(n)
    total = [round(c * s) + k for c, s, k in zip(costs, split.shares, coll)]
    firsts = [g[0] for g in groups]
    if len(groups) == 1:
        ends = [n]
    else:
        links_in = None
        if links is not None:
            links_in = [links.link(firsts[max(k - 1, 0)], firsts[k]) for k in range(len(groups))]
        problem = PartitionProblem(total, [None] * len(groups), info, allowed_cuts=allowed, links_in=links_in)
        ends = problem.min_transfer(problem.min_bottleneck() if objective == "throughput" else None)
    plan = build_plan(
        info,
        total,
        ends,
        firsts,
        [None] * len(groups),
        cost_kind="time",
        objective=objective,
        fp=fp,
        links=links,
    )
    all_params = sum(info.param_bytes) or 1
    rows: list[DevicePlan] = []
    start = 0
    used = []
    for row, end, group, group_coll in zip(plan.devices, ends, groups, per_group):
        charged, seg_coll, seg_bytes = (
            sum(coll[start:end]),
            sum(group_coll[start:end]),
            sum(received[start:end]),
        )
        start = end
        if not row.ops:  # a stage the plan leaves empty (one request's time: fewer stages)
            continue
        used.append((group, seg_coll))
        for d, device in enumerate(group):
            params = (
                split.param_bytes[d]
                if len(groups) == 1
                else round(row.param_bytes * split.param_bytes[d] / all_params)
            )
            rows.append(
                dataclasses.replace(
                    row,
                    device=str(device),
                    cost=row.cost - charged,
                    param_bytes=params,
                    degree=len(group),
                    collective_time=seg_coll,
                    collective_bytes=seg_bytes,
                )
            )
    plan.devices = rows
    plan.bottleneck = max(r.stage_cost for r in rows)
    plan.total_cost = sum(costs)
    plan.tensor_parallel = [len(g) for g, _ in used]
    plan.groups = [[str(d) for d in g] for g, _ in used]
    plan.collective_time = sum(c for _, c in used)
    plan.collectives = len(split.collectives)
    return plan
