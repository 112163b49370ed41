"""``auto_place`` for one GPU plus host memory: :func:`placement.plan_offload`, reported as a :class:`Plan`.

accelerate users write ``auto_place(model, max_memory={0: "2GiB", "cpu": "48GiB"})``. Such a
budget goes to :func:`placement.plan_offload`, which gives every layer a mode (resident on
the GPU, streamed from the host, or computed on the host) from predicted times. The times
need the devices' speeds (:func:`placement.planning.speeds.device_speeds`: given, measured
here, or the stated default, a GPU being a hundred times the host), so a plan never
weighs the host like a GPU.

The :class:`Plan` it returns is in time (``cost_kind="time"``, nanoseconds predicted from
those speeds and the host -> GPU link): each device's row holds the compute of the layers
it runs, its weights (the GPU's: resident weights plus twice the prefetch window), its
activations' peak and the copies into it (streamed weights included);
:attr:`Plan.bottleneck` is the simulated forward and :attr:`Plan.lower_bound` the same
model all on its fastest device without a budget. :attr:`Plan.offload` holds each layer's
mode, the speeds and their sources.

Example:
    >>> import placement as pl
    >>> from placement.models import gpt
    >>> model = pl.from_torch(*gpt.build("tiny"))
    >>> plan = pl.auto_place(model, max_memory={0: "60KiB", "cpu": "1GiB"}, cost="flops",
    ...                      throughput={"cuda": 1e13, "cpu": 1e8})
    >>> plan.cost_kind, plan.fits, plan.offload["speeds"]["cuda"]
    ('time', True, 10000000000000.0)
    >>> any(op.device.type == "cuda" for op in model.ops)
    True
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from placement.errors import PlanError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.sizes import format_bytes
from placement.planning.evaluate import evaluate_assignment
from placement.planning.graph_info import GraphInfo
from placement.planning.link_model import LinksLike, resolve_links
from placement.planning.offload import OffloadPlan, is_offload_budget, plan_offload
from placement.planning.offload_search import gpu_activations
from placement.planning.plan import Plan
from placement.planning.profile import fingerprint
from placement.planning.speeds import device_speeds

__all__ = ["auto_offload", "offload_report"]

log = logging.getLogger(__name__)


def auto_offload(
    model: Model,
    devices: list[Device],
    budgets: list[int | None],
    *,
    cost: str,
    objective: str,
    links: LinksLike,
    sample_inputs: Any,
    repeats: int,
    runtime: str,
    throughput: Mapping[str, float] | None = None,
    dims: Mapping[str, int] | None = None,
    kv_cache: tuple[int, int] | None = None,
) -> Plan:
    """Plan ``model`` on one GPU plus the host (in place) and report it as a :class:`Plan`.

    ``cost`` is ``"time"`` (host op times measured here) or ``"flops"`` (``"size"`` plans
    with FLOPs too: a plan across a GPU and a host must weigh compute by each device's speed).
    ``throughput``: FLOP/s per device type; types left out are measured here, else take
    :data:`placement.planning.speeds.DEFAULT_FLOPS`.

    Raises:
        PlanError: the devices are not one GPU with a budget followed by the host.
        InfeasiblePlacementError: no layer assignment fits both budgets.
    """
    if not is_offload_budget(devices, budgets):
        raise PlanError("offload=True needs exactly one GPU with a budget, then the host")
    kind = cost if cost in ("time", "flops") else "flops"
    speeds = device_speeds(throughput, gpu_index=devices[0].index or 0)
    log.info("auto_place: device speeds %s", speeds.describe())
    offload = plan_offload(
        model,
        {devices[0]: budgets[0], devices[1]: budgets[1]},
        links=links,
        cost=kind,
        sample_inputs=sample_inputs,
        repeats=repeats,
        throughput=speeds.rates,
        batch=dims,
        kv_cache=kv_cache,
    )
    plan = offload_report(model, offload, links=links, objective=objective, runtime=runtime)
    plan.offload["speeds"] = dict(speeds.rates)
    plan.offload["speed_sources"] = dict(speeds.sources)
    plan.offload["op_times"] = "measured on the host" if kind == "time" else "from FLOPs"
    plan.apply(model)
    log.info("auto_place: %s", offload)
    return plan


def offload_report(
    model: Model,
    offload: OffloadPlan,
    *,
    links: LinksLike = "auto",
    objective: str = "throughput",
    runtime: str = "ort",
) -> Plan:
    """The :class:`Plan` of an :class:`OffloadPlan` (times in ns; see the module docstring).

    Example:
        >>> import placement as pl
        >>> from placement.models import gpt
        >>> model = pl.from_torch(*gpt.build("tiny"))
        >>> offload = pl.plan_offload(model, {0: "60KiB"}, cost="flops", apply=False)
        >>> plan = offload_report(model, offload)
        >>> plan.bottleneck == offload.predicted_ns, plan.lower_bound <= plan.bottleneck
        (True, True)
    """
    info = GraphInfo(model, dims=offload.bindings)
    modes = [offload.modes[layer.name] for layer in offload.layers]
    part = [
        int(mode == "host")
        for layer, mode in zip(offload.layers, modes)
        for _ in range(layer.start, layer.end)
    ]
    link_model = resolve_links(links)
    plan = evaluate_assignment(
        info,
        [0] * len(info),
        part,
        [offload.gpu, offload.host],
        list(offload.budgets),
        cost_kind="time",
        objective=objective,
        fp=fingerprint(model),
        links=link_model,
    )
    gpu_row, host_row = plan.devices
    gpu_row.cost = sum(layer.gpu_ns for layer, mode in zip(offload.layers, modes) if mode != "host")
    host_row.cost = sum(layer.host_ns for layer, mode in zip(offload.layers, modes) if mode == "host")
    streamed = offload.streamed_parameters()
    streamed_bytes = sum(info.param_bytes[info.param_names.index(name)] for name in streamed)
    gpu_row.kv_cache_bytes, host_row.kv_cache_bytes = offload.kv_cache_bytes()
    gpu_row.param_bytes = (
        offload.gpu_bytes - gpu_activations(info, offload.layers)(modes) - gpu_row.kv_cache_bytes
    )
    gpu_row.bytes_in += streamed_bytes
    gpu_row.transfer_time += offload.copy_ns
    host_row.param_bytes = offload.host_bytes - host_row.kv_cache_bytes
    host_row.bytes_out += streamed_bytes
    plan.bottleneck = offload.predicted_ns
    plan.lower_bound = sum(min(layer.gpu_ns, layer.host_ns) for layer in offload.layers)
    plan.total_cost = gpu_row.cost + host_row.cost
    plan.transfer_bytes += streamed_bytes
    plan.overhead = max(0, offload.predicted_ns - plan.total_cost)
    plan.streamed = {name: str(offload.host) for name in streamed}
    plan.stream_window = offload.window if streamed else None
    plan.runtime = runtime
    plan.dims = dict(offload.bindings)
    plan.offload = {
        "modes": dict(offload.modes),
        "window": offload.window,
        "all_gpu_ns": offload.all_gpu_ns,
        "copy_ns": offload.copy_ns,
    }
    if all(mode == "host" for mode in modes) or not gpu_row.cost:
        plan.offload["note"] = _why_gpu_idle(info, offload)
    return plan


def _why_gpu_idle(info: GraphInfo, offload: OffloadPlan) -> str:
    """Why no compute runs on the GPU: the smallest GPU need of a layer worth running there (its
    compute there and the copies of its activations take less than its host time), or the link."""
    peak = gpu_activations(info, offload.layers)
    needs = []
    for k, layer in enumerate(offload.layers):
        copies = offload.link.time_ns(layer.in_bytes + layer.out_bytes)
        if not layer.gpu_ns or layer.gpu_ns + copies >= layer.host_ns:
            continue
        modes = ["host"] * len(offload.layers)
        modes[k] = "resident"
        weights = sum(layer.weights.values())
        needs.append((weights + peak(modes), layer.name, weights, peak(modes)))
    budget = offload.budgets[0]
    if not needs:
        return "the GPU computes nothing: copying activations to it costs more than it saves"
    need, name, weights, acts = min(needs)
    if budget is not None and need > budget:
        return (
            f"the GPU computes nothing: the smallest layer worth running there, {name}, needs "
            f"{format_bytes(need)} there ({format_bytes(weights)} of weights + {format_bytes(acts)} of "
            f"activations), over its budget of {format_bytes(budget)}"
        )
    return "the GPU computes nothing: the plans that use it are slower (copies, or a stalled stream)"
