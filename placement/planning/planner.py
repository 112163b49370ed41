"""The automatic planner: exact bottleneck-optimal contiguous partitions under memory budgets.

``auto_place(model, devices=N)`` or ``auto_place(model, max_memory={0: "2GB", 1: "6GB"})``
cuts the graph order (a topological order: the exporter's, which follows the forward
code) into at most one contiguous part per device, part ``k`` on the ``k``-th device,
applies the result to the model in place and returns a :class:`Plan`.

Costs per op come from the profiler (:mod:`placement.planning.profile`): measured time
(``cost="time"``, nanoseconds), parameter plus output bytes (``"size"``) or analytic
FLOPs (``"flops"``); all are integers, which makes the search below exact.

Memory of a part is the bytes of the distinct parameters its ops read (a parameter read
by ops of several parts, like GPT's tied embedding, counts on every one of them: it is
a static copy there) plus the liveness-based peak of its activations (see
:meth:`GraphInfo.segment_peak_activation`). Both can only shrink when a part shrinks.

A cut never falls right after an op that depends on no graph input (a weight
transpose, shape arithmetic): its result is a load-time value that runtimes fold where
it is read, so the op stays with the op after it, which reads it
(:func:`constant_glue`). All results below are exact over the partitions that remain.

Objectives:

* ``"throughput"`` (default; pipelined execution): minimise the bottleneck, the largest
  part cost. For additive costs and memory that is monotone under taking sub-segments,
  whether a bottleneck ``T`` is achievable is decided exactly by a greedy sweep (each
  device takes the longest prefix of what is left that stays within ``T`` and its
  budget: an exchange argument shows no partition reaches further), so an integer
  bisection on ``T`` finds the optimum ``T*`` exactly in O(log(total)) sweeps. Among
  all partitions with bottleneck ``T*`` a dynamic programme over cut points then picks
  one that copies the fewest bytes per step. The result is the exact lexicographic
  optimum (bottleneck, then bytes copied) over contiguous partitions of the order.
* ``"latency"`` (one request at a time): the compute along the chain is the same for
  every contiguous partition, so latency differs only by transfers; the planner
  minimises the bytes copied per step subject to the budgets, then the bottleneck
  (exact, by the same dynamic programme). With room to spare this keeps everything
  on the first device, which is the fastest way to run one request.

Communication (``cost="time"``): a link model (:mod:`placement.planning.link_model`, by
default typical links by device type; ``links=pl.measure_links()`` for this
machine's) turns every copy into time, ``latency + bytes / bandwidth``, and a part's
cost becomes its op costs plus the time to copy in every blob it reads from earlier
parts, plus what cuts inside fusable patterns cost it
(:mod:`placement.planning.fusion`, measured). The throughput objective is then the
bottleneck over parts of that cost (a pipelined stage receives, then computes), the
latency objective the sum of the transfer and cut times along the chain. A part's
cost no longer shrinks with the part (starting one op later can add a copy), so the
greedy sweep is replaced by an exact min-max dynamic programme, then the same
dynamic programme as above picks, among partitions at the optimal bottleneck, the
one with the least transfer and cut time. Both are exact when, for every device,
all links into it from earlier devices are alike (one kind of interconnect, or
the links from :func:`placement.measure_links` between two devices); otherwise the
planner charges a copy on the link from the previous device in the pipeline, and
the plan reports the times on the true links.

Which runtime (``runtime=``, ``cost="time"``): the ONNX Runtime executor runs each
stage as one *optimised* session (fused kernels, blocked convolution layouts), torch
runs op by op; per-op times differ between the two (a ResNet's Conv+BN+ReLU is much
cheaper fused), so a plan balanced for one can be unbalanced for the other. The
default ``"ort"`` times ops in an optimised session (each fused node's time to the op
it came from) and allows only cuts that split no fused group
(:func:`placement.planning.fusion.fused_cuts`: exact, read from ONNX Runtime's own
optimised graph, so no timing noise); ``"torch"`` times ops one by one and charges
measured fusion cut costs. Fusion is a property of the graph that a measured penalty
could only estimate (and on a loaded machine such penalties read 0-7 ms at
neighbouring cuts), which is why it is a constraint here. What per-op times still
miss (session call overhead, layout conversions at a stage's edges, profiling noise)
is corrected by calibrating on the measured stage sessions
(:func:`placement.runtime.calibrate.calibrate`, which re-plans with ``op_costs=``).

Bytes copied per step count one copy per (blob, reading device), as
``inject_cross_device_copies`` makes them; graph inputs are fed where first read;
blobs computed from parameters alone are load-time values the runtimes
rematerialise where they are read, so they move nothing per step.
The dynamic programme is O(N * sum of part lengths) in the worst case, fine for
graphs of a few thousand ops.

Example:
    >>> import placement as pl
    >>> from placement.models import gpt
    >>> model = pl.from_torch(*gpt.build("tiny"))
    >>> plan = pl.auto_place(model, devices=2, cost="flops")
    >>> [str(d) for d in model.devices]
    ['cuda:0', 'cuda:1']
    >>> plan.lower_bound <= plan.bottleneck <= 1.1 * plan.lower_bound
    True
    >>> pl.Plan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from placement.errors import PlanError, UnknownOpError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model
from placement.graph.sizes import format_bytes, parse_bytes
from placement.planning.dims import called_as, planned_dims
from placement.planning.evaluate import build_plan, evaluate_assignment
from placement.planning.frontend import check_no_copies
from placement.planning.graph_info import GraphInfo, add_kv_cache
from placement.planning.link_model import Links, LinksLike, resolve_links
from placement.planning.offload import is_offload_budget
from placement.planning.partition import PartitionProblem, constant_glue
from placement.planning.plan import Plan
from placement.planning.profile import COST_KINDS, _normalise_inputs, profile

__all__ = ["auto_place", "build_plan", "evaluate_assignment", "unapplied_plan", "OBJECTIVES", "RUNTIMES"]

log = logging.getLogger(__name__)


OBJECTIVES = ("throughput", "latency")
#: What ``auto_place(runtime=...)`` balances a plan for.
RUNTIMES = ("ort", "torch")


def _resolve_devices(
    devices: int | Sequence[DeviceLike] | None, max_memory: Mapping[Any, Any] | None
) -> tuple[list[Device], list[int | None]]:
    budgets_by_device: dict[Device, int] = {}
    if max_memory is not None:
        if not isinstance(max_memory, Mapping):
            raise PlanError(f"max_memory must map devices to sizes, got {type(max_memory).__name__}")
        for key, spec in max_memory.items():
            budgets_by_device[Device.parse(key)] = parse_bytes(spec)
    if devices is None:
        if not budgets_by_device:
            raise PlanError("auto_place needs devices=N, a list of devices, or max_memory")
        device_list = list(budgets_by_device)
    elif isinstance(devices, bool):
        raise PlanError(f"devices must be a count or a list, got {devices!r}")
    elif not isinstance(devices, (int, Sequence)) or isinstance(devices, (str, bytes)):
        raise PlanError(f"devices must be a count or a list of devices, got {devices!r}")
    elif isinstance(devices, int):
        if devices < 1:
            raise PlanError(f"need at least one device, got devices={devices}")
        device_list = [Device("cuda", k) for k in range(devices)]
    else:
        device_list = [Device.parse(d) for d in devices]
        if not device_list:
            raise PlanError("devices is empty")
    if len(set(device_list)) != len(device_list):
        raise PlanError(f"devices repeat: {[str(d) for d in device_list]}")
    extra = [d for d in budgets_by_device if d not in device_list]
    if extra:
        raise PlanError(
            f"max_memory names {extra[0]}, which is not among devices {[str(d) for d in device_list]}"
        )
    return device_list, [budgets_by_device.get(d) for d in device_list]


def _time_or_flops(model: Model) -> str:
    """``"time"``, or ``"flops"`` (logged) when timing the model would not fit in memory."""
    weights = sum(
        int(v.const_value.nbytes) for v in model.graph.initializers.values() if v.const_value is not None
    )
    available = _available_memory()
    if available is not None and 2 * weights > available:
        log.warning(
            "auto_place: timing needs about %s of memory (the weights twice) but %s is available; "
            "planning with cost='flops' instead",
            format_bytes(2 * weights),
            format_bytes(available),
        )
        return "flops"
    return "time"


def _available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _override_costs(info: GraphInfo, costs: Sequence[int], op_costs: Mapping[str, float]) -> list[int]:
    unknown = [name for name in op_costs if name not in info.position]
    if unknown:
        raise UnknownOpError(f"op_costs names op {unknown[0]!r}, which is not in the model")
    result = list(costs)
    for name, value in op_costs.items():
        if not value >= 0 or not math.isfinite(value):
            raise PlanError(f"op_costs[{name!r}] must be a finite non-negative number, got {value!r}")
        result[info.position[name]] = round(value)
    return result


def auto_place(
    model: Model,
    devices: int | Sequence[DeviceLike] | None = None,
    max_memory: Mapping[Any, int | float | str] | None = None,
    *,
    sample_inputs: Any = None,
    cost: str = "time",
    objective: str = "throughput",
    repeats: int = 5,
    links: LinksLike = "auto",
    fusion: bool = True,
    runtime: str = "ort",
    op_costs: Mapping[str, float] | None = None,
    offload: bool | None = None,
    throughput: Mapping[str, float] | None = None,
    batch: int | Mapping[str, int] | None = None,
    kv_cache: tuple[int, int] | None = None,
    tensor_parallel: int | str | None = None,
) -> Plan:
    """Plan and apply an optimal contiguous placement; return the :class:`Plan`.

    One GPU plus host memory (``max_memory={"cuda:0": "2GiB", "cpu": "48GiB"}``, or
    accelerate's ``{0: "2GiB", "cpu": "48GiB"}``) is planned by
    :func:`placement.plan_offload` instead (``offload=None``: whenever the devices are
    one GPU with a budget and then the host): each layer stays resident on the GPU,
    streams its weights from the host or runs on the host, chosen from predicted times
    on each device's speed (``throughput``), and the plan's :attr:`Plan.streamed` names
    the parameters kept on the host (see :mod:`placement.planning.auto_offload`).

    Args:
        model: the model, placed in place.
        devices: a device count (``cuda:0 .. cuda:N-1``) or a list of devices, in
            pipeline order. Optional when ``max_memory`` is given (its keys, in order).
        max_memory: device -> budget for parameters plus peak activations, in bytes or
            as ``"2GB"`` / ``"512MiB"``; devices left out are unlimited.
        sample_inputs: inputs for time profiling (see :func:`placement.profile`); on a
            model with symbolic dimensions (a dynamic batch) their sizes are also the
            sizes activations and copies count at against ``max_memory``.
        cost: ``"time"`` (measured), ``"size"`` (parameter + output bytes) or ``"flops"``.
            Timing runs the whole model in one ONNX Runtime session whose weights
            bypass the protobuf, so models over 2 GB are timed too; when the
            weights need more memory than is available (about twice their size:
            the model's arrays plus ONNX Runtime's packed copies), ``"flops"`` is
            used instead and a warning is logged.
        objective: ``"throughput"`` (minimise the bottleneck, then bytes copied) or
            ``"latency"`` (minimise bytes copied, then the bottleneck); see the module
            docstring.
        repeats: timed runs when profiling.
        links: the link model copies are charged on (``cost="time"`` only): ``"auto"``
            (typical links by device type, :class:`placement.planning.link_model.Links`),
            a preset (``"pcie"``, ``"nvlink"``, ``"host"``, ``"memcpy"``), a
            :class:`~placement.planning.link_model.Link`, a mapping
            ``(source, destination) -> link``, links measured by
            :func:`placement.measure_links`, or None (transfers cost nothing).
        fusion: with ``cost="time"``, respect what ONNX Runtime fuses. For
            ``runtime="ort"``: never cut inside a group its graph optimisations fuse
            into one kernel (read from its optimised graph, no timing; see
            :func:`placement.planning.fusion.fused_cuts`). For ``runtime="torch"``:
            charge a cut inside a fusable pattern (Conv+BatchNormalization(+Add)+Relu,
            MatMul+Add(+activation)) what ONNX Runtime loses by running its halves
            apart, measured (:func:`placement.planning.fusion.fusion_cut_costs`).
        runtime: which executor the plan is balanced for (``cost="time"`` only).
            ``"ort"`` (default; ``pl.Runner``, ``pl.run``, the saved ONNX): ops are
            timed in one ONNX Runtime session with graph optimisations on, as the
            stage sessions run, each fused or re-laid-out node's time going to the op
            it came from (:func:`placement.profile` with ``optimized=True``), and no
            part boundary splits a fused group. ``"torch"`` (``pl.to_torch``, torch
            eager; op-by-op runtimes): ops are timed one by one with optimisations
            off. The two differ most on convolutional nets, whose fused
            Conv+BN+ReLU kernels run much faster than their ops one by one. For a
            plan balanced on *measured* stage sessions, see
            :func:`placement.runtime.calibrate.calibrate`.
        offload: plan one GPU plus the host with :func:`placement.plan_offload` (``None``:
            when the devices are exactly that; ``False``: a contiguous GPU-then-host split).
        throughput: for an offload plan, FLOP/s per device type (``{"cuda": 60e12,
            "cpu": 1e12}``); a type left out is measured on this machine (the host
            always, a GPU that torch sees) or takes the stated default
            (:data:`placement.planning.speeds.DEFAULT_FLOPS`).
        batch: the batch to plan for when the graph inputs have symbolic dimensions:
            an int binds every symbol the sample inputs do not size, a mapping binds
            the symbols it names (``{"batch": 8, "seq": 128}``); default 1 (sizes per
            example). See :mod:`placement.planning.dims`; the plan's ``dims`` says
            what was used.
        kv_cache: ``(batch, max_length)`` for a model with a KV cache
            (:func:`placement.from_causal_lm`): each layer's cache at that batch and length
            counts in the memory of the device of the op making its ``present``.
        tensor_parallel: split stages *through* their ops over groups of devices
            (:func:`placement.split_tensor_parallel`), with the degree from the cost model
            (:mod:`placement.planning.tp_planner`): ``"auto"`` weighs every divisor ``t`` of
            the device count ``N`` (1: the ordinary plan; ``N``: one stage split over all
            devices; in between: ``N / t`` pipeline stages, each split over its own group of
            ``t`` devices, tensor inside pipeline) and keeps the best for ``objective``; an
            int applies that degree. The plan's ``groups`` are the stages' devices. Op
            costs are times (``cost="flops"`` turns FLOPs into times at the device's speed,
            ``throughput``), collectives cost their copies over ``links`` plus a fixed latency
            each. Under ``max_memory`` a degree whose devices do not fit is left out (a split
            device holds its shards, the replicated parameters and the stage's peak
            activations, counted unsplit). None (default): no tensor parallelism. The
            plan's ``tensor_parallel``, ``collective_time`` and ``tp_choices`` say what was
            chosen and why; a split model has its copies injected.
        op_costs: op name -> cost (in ``cost``'s unit: ns for ``"time"``) replacing
            the profiled cost of those ops; other ops keep theirs. Calibration
            (:func:`placement.runtime.calibrate.calibrate`) re-plans this way with
            costs scaled to measured stage times.

    Raises:
        InfeasiblePlacementError: no placement fits the budgets; the message gives the
            smallest uniform budget that would.
        PlanError: bad arguments, or the model already has copies.
        InputError: a tensor-parallel degree the split pass cannot split the model over (it
            names the op).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> plan = pl.auto_place(model, max_memory={0: 10**9, 1: "1GB"}, cost="size")
        >>> plan.fits, len(plan.devices)
        (True, 2)
    """
    if cost not in COST_KINDS:
        raise PlanError(f"unknown cost {cost!r}; expected one of {', '.join(COST_KINDS)}")
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown objective {objective!r}; expected one of {', '.join(OBJECTIVES)}")
    if runtime not in RUNTIMES:
        raise PlanError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
    with called_as("auto_place"):
        return _auto_place(
            model,
            devices,
            max_memory,
            sample_inputs=sample_inputs,
            cost=cost,
            objective=objective,
            repeats=repeats,
            links=links,
            fusion=fusion,
            runtime=runtime,
            op_costs=op_costs,
            offload=offload,
            throughput=throughput,
            batch=batch,
            kv_cache=kv_cache,
            tensor_parallel=tensor_parallel,
        )


def _pipeline_plan(
    info: GraphInfo,
    costs: Sequence[int],
    device_list: list[Device],
    budgets: list[int | None],
    *,
    allowed: list[bool],
    cuts: Any,
    links: Any,
    objective: str,
    cost_kind: str,
    fp: str,
) -> Plan:
    """The exact contiguous plan of ``costs`` over ``device_list`` (not applied)."""
    links_in = None
    if links is not None:
        links_in = [links.link(device_list[max(k - 1, 0)], device_list[k]) for k in range(len(device_list))]
        if not links.uniform_into(device_list):
            log.info(
                "auto_place: links into some device differ by source; copies are planned on the "
                "link from the previous device (exact only when all links into a device are alike)"
            )
    problem = PartitionProblem(costs, budgets, info, allowed_cuts=allowed, links_in=links_in, cut_costs=cuts)
    if objective == "throughput":
        bound = problem.min_bottleneck()
        ends = problem.min_transfer(bound)
    else:
        ends = problem.min_transfer(None)
    return build_plan(
        info,
        costs,
        ends,
        device_list,
        budgets,
        cost_kind=cost_kind,
        objective=objective,
        fp=fp,
        links=links,
        cut_costs=cuts,
    )


def _cuts(
    model: Model, info: GraphInfo, *, fusion: bool, runtime: str, repeats: int
) -> tuple[list[bool], list[tuple[int, int]] | None]:
    """Where parts may end, and what cuts cost (see ``auto_place``'s ``fusion``)."""
    allowed = constant_glue(info)
    cuts = None
    if fusion:
        from placement.planning.fusion import fused_cuts, fusion_cut_costs

        if runtime == "ort":
            allowed = [a and f for a, f in zip(allowed, fused_cuts(model, info))]
        else:
            cuts = fusion_cut_costs(model, info, repeats=repeats)
    return allowed, cuts


def unapplied_plan(
    model: Model,
    devices: int,
    *,
    links: Links | None,
    tensor_parallel: int | str,
    op_costs: Mapping[str, float] | None = None,
    throughput: Mapping[str, float] | None = None,
    objective: str = "throughput",
) -> Plan:
    """The plan ``auto_place(model, devices, tensor_parallel=...)`` would make, without
    applying it (what :func:`placement.predict` asks).
    ``throughput`` (FLOP/s per device type) plans on FLOPs at that speed instead of times."""
    return _auto_place(
        model,
        devices,
        None,
        sample_inputs=None,
        cost="time" if throughput is None else "flops",
        objective=objective,
        repeats=5,
        links=links,
        fusion=True,
        runtime="ort",
        op_costs=op_costs,
        offload=False,
        throughput=throughput,
        batch=None,
        kv_cache=None,
        tensor_parallel=tensor_parallel,
        apply=False,
    )


def _auto_place(
    model: Model,
    devices: int | Sequence[DeviceLike] | None,
    max_memory: Mapping[Any, int | float | str] | None,
    *,
    sample_inputs: Any,
    cost: str,
    objective: str,
    repeats: int,
    links: LinksLike,
    fusion: bool,
    runtime: str,
    op_costs: Mapping[str, float] | None,
    offload: bool | None,
    throughput: Mapping[str, float] | None,
    batch: int | Mapping[str, int] | None,
    kv_cache: tuple[int, int] | None,
    tensor_parallel: int | str | None = None,
    apply: bool = True,
) -> Plan:
    """``auto_place``'s work; ``apply=False`` (predictions) leaves the model unplaced."""
    check_no_copies(model, "auto_place")
    device_list, budgets = _resolve_devices(devices, max_memory)
    if tensor_parallel is not None:
        from placement.planning.tp_planner import check_tensor_parallel

        check_tensor_parallel(cost, offload)
        offload = False
    feeds = None if sample_inputs is None else _normalise_inputs(model, sample_inputs)
    dims = planned_dims(model, sample_inputs=feeds, batch=batch)
    if offload is None:
        offload = is_offload_budget(device_list, budgets)
    if offload:
        from placement.planning.auto_offload import auto_offload

        if cost == "time":
            cost = _time_or_flops(model)
        options = dict(
            objective=objective, links=links, repeats=repeats, runtime=runtime, throughput=throughput
        )
        return auto_offload(
            model, device_list, budgets, cost=cost, sample_inputs=feeds, dims=dims, kv_cache=kv_cache,
            **options,
        )
    timed = cost == "time" or tensor_parallel is not None  # tensor parallelism plans in times
    if not timed and links is not None and links is not False and links != "auto":
        raise PlanError(f"links are times: they need cost='time', not cost={cost!r}")
    if cost == "time":
        cost = _time_or_flops(model)
    link_model = resolve_links(links) if timed else None
    prof = profile(
        model,
        sample_inputs=feeds,
        time=cost == "time",
        repeats=repeats,
        optimized=runtime == "ort",
        dims=dims,
    )
    costs = prof.costs(cost)
    info = GraphInfo(model, dims=dims)
    if kv_cache is not None:
        add_kv_cache(info, model, kv_cache)
    if op_costs is not None:
        costs = _override_costs(info, costs, op_costs)
    allowed, cuts = _cuts(
        model,
        info,
        fusion=fusion and cost == "time" and len(device_list) > 1,
        runtime=runtime,
        repeats=repeats,
    )

    def pipeline(plan_costs: Sequence[int] = costs, kind: str = cost) -> Plan:
        return _pipeline_plan(
            info,
            plan_costs,
            device_list,
            budgets,
            allowed=allowed,
            cuts=cuts,
            links=link_model,
            objective=objective,
            cost_kind=kind,
            fp=prof.fingerprint,
        )

    if tensor_parallel is None:
        plan = pipeline()
    else:
        from placement.planning.tp_planner import flops_as_ns, plan_tensor_parallel

        ns = costs if cost == "time" else flops_as_ns(costs, device_list[0], throughput)
        plan = plan_tensor_parallel(
            model,
            info,
            ns,
            device_list,
            tensor_parallel,
            pipeline=lambda: pipeline(ns, "time"),
            objective=objective,
            links=link_model,
            allowed=allowed,
            dims=dims,
            fp=prof.fingerprint,
            budgets=budgets,
        )
    plan.runtime = runtime
    plan.dims = dict(dims)
    if apply:
        plan.apply(model)
    log.info(
        "auto_place: %d ops on %d devices, bottleneck %.3f x lower bound, %d bytes copied per step",
        len(info),
        len(device_list),
        plan.ratio,
        plan.transfer_bytes,
    )
    return plan
