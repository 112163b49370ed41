"""Scoring a placement: a partition or any op -> device assignment evaluated into a :class:`Plan`.

:func:`build_plan` turns the planner's part ends into a plan; :func:`evaluate_assignment`
scores any assignment with the same cost, memory and link model (the planner's plans,
the offload report, and other tools' placements in the benchmarks).

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.planning.graph_info import GraphInfo
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> info = GraphInfo(model)
    >>> costs = pl.profile(model, time=False).costs("flops")
    >>> devices = [pl.Device("cuda", 0), pl.Device("cuda", 1)]
    >>> plan = build_plan(info, costs, [2, len(info)], devices, [None, None], cost_kind="flops",
    ...                   objective="throughput")
    >>> plan.devices[0].ops, plan.total_cost == sum(costs)
    (2, True)
"""

from __future__ import annotations

from collections.abc import Sequence

from placement.graph.device import Device
from placement.planning.graph_info import GraphInfo
from placement.planning.link_model import Links
from placement.planning.plan import DevicePlan, Plan

__all__ = ["build_plan", "evaluate_assignment"]


def build_plan(
    info: GraphInfo,
    costs: Sequence[int],
    ends: Sequence[int],
    devices: Sequence[Device],
    budgets: Sequence[int | None],
    *,
    cost_kind: str,
    objective: str,
    fp: str = "",
    links: Links | None = None,
    cut_costs: Sequence[tuple[int, int]] | None = None,
) -> Plan:
    """Evaluate a contiguous partition (part ends) into a :class:`Plan`."""
    n = len(info)
    part = [0] * n
    start = 0
    for k, end in enumerate(ends):
        for pos in range(start, end):
            part[pos] = k
        start = end
    return evaluate_assignment(
        info,
        costs,
        part,
        devices,
        budgets,
        cost_kind=cost_kind,
        objective=objective,
        fp=fp,
        links=links,
        cut_costs=cut_costs,
    )


def evaluate_assignment(
    info: GraphInfo,
    costs: Sequence[int],
    part: Sequence[int],
    devices: Sequence[Device],
    budgets: Sequence[int | None],
    *,
    cost_kind: str,
    objective: str,
    fp: str = "",
    links: Links | None = None,
    cut_costs: Sequence[tuple[int, int]] | None = None,
) -> Plan:
    """Evaluate any assignment ``part[pos]`` (index into ``devices``) into a :class:`Plan`.

    Used for our plans and, in the benchmark, to score other tools' placements with the
    same cost and memory model. Each copy is charged on the link from the device
    that makes (or is fed) the blob to the device reading it.
    """
    num = len(devices)
    n = len(info)
    total = sum(costs)
    part_cost = [0] * num
    for pos in range(n):
        part_cost[part[pos]] += costs[pos]
    params = info.part_param_bytes(part, num)
    acts = info.peak_activations(part, num)
    state = info.part_state_bytes(part, num)
    out, into = info.transfers(part, num)
    into_time = [0] * num
    if links is not None:
        for size, home, p in info.copies(part):
            into_time[p] += links.link(devices[home], devices[p]).time_ns(size)
    cut_cost = [0] * num
    if cut_costs is not None:
        for c in range(1, n):
            if part[c] != part[c - 1]:
                cut_cost[part[c - 1]] += int(cut_costs[c][0])
                cut_cost[part[c]] += int(cut_costs[c][1])
    rows = []
    for k, device in enumerate(devices):
        members = [pos for pos in range(n) if part[pos] == k]
        rows.append(
            DevicePlan(
                device=str(device),
                ops=len(members),
                first_op=info.names[members[0]] if members else None,
                last_op=info.names[members[-1]] if members else None,
                cost=part_cost[k],
                param_bytes=params[k],
                activation_bytes=acts[k],
                budget=budgets[k],
                bytes_in=into[k],
                bytes_out=out[k],
                transfer_time=into_time[k],
                cut_cost=cut_cost[k],
                kv_cache_bytes=state[k],
            )
        )
    cut_bytes = []
    for c in range(1, n):
        if part[c] != part[c - 1]:
            cut_bytes.append(info.cut_bytes(c))
    lower = max(max(costs, default=0), -(-total // num)) if n else 0
    return Plan(
        assignment={info.names[pos]: str(devices[part[pos]]) for pos in range(n)},
        devices=rows,
        cost_kind=cost_kind,
        objective=objective,
        bottleneck=max((row.stage_cost for row in rows), default=0),
        lower_bound=lower,
        total_cost=total,
        transfer_bytes=sum(into),
        cut_bytes=cut_bytes,
        fingerprint=fp,
        overhead=sum(into_time) + sum(cut_cost),
        links=links.to_dict() if links is not None else None,
    )
