"""One GPU plus host memory: which layers stay on the GPU, which stream their weights, which run on the host.

``plan_offload(model, max_memory={"cuda:0": "2GiB", "cpu": "48GiB"})`` (accelerate's
spelling ``{0: "2GiB", "cpu": "48GiB"}`` too; ``auto_place`` comes here for such a
budget) cuts the graph order into *layers* (maximal runs of ops of one repeated
block, ``h.3`` or ``layers.7``, or of one top-level module) and gives each a mode:

* ``resident``: its ops run on the GPU and its weights live there;
* ``streamed``: its ops run on the GPU, its weights live in pinned host memory and
  are copied every run on a side stream, prefetched while earlier layers compute
  (:func:`placement.stream_parameters`);
* ``host``: its ops run on the host; only activations cross the link.

The GPU budget counts the resident weights, the prefetch window (room for the
largest streamed layer in use plus the next one in flight) and the peak of the
activations; the host budget counts the weights that live there. The mode is chosen
from predicted times: each layer's compute time on the GPU and on the host (measured
on this machine's CPU, or given; a device that cannot be timed here is estimated
from the host times and the devices' FLOP rates) and the link's bandwidth
(``links``: a preset, a :class:`~placement.planning.link_model.Link`, or
:func:`placement.measure_links` for this machine's). A simulation of one forward
(GPU compute stream, copy stream, the window's room, host layers with their
activation copies) predicts each candidate's time:

* a streamed layer's copy hides only behind the compute that runs between its
  prefetch and its use, so the layers taken off the GPU are spread evenly over the
  order (interleaved with resident ones) rather than taken as a block: streaming
  consecutive layers stalls the GPU on every copy;
* each layer taken off is then streamed or run on the host, whichever the
  simulation predicts faster (a fast link streams; a slow link, or a layer whose
  weights are large for its compute, runs on the host);
* among the numbers of layers to take off that fit both budgets, the fastest wins.

Example:
    >>> import placement as pl
    >>> from placement.models import gpt
    >>> model = pl.from_torch(*gpt.build("tiny"))
    >>> plan = pl.plan_offload(model, max_memory={0: "40KiB", "cpu": "1GiB"}, cost="flops", links="host")
    >>> plan.fits, sorted(set(plan.modes.values())) <= ["host", "resident", "streamed"]
    (True, True)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from placement.errors import InfeasiblePlacementError, PlanError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import STREAMED_KEY, node_scope, set_node_device
from placement.graph.sizes import format_bytes, parse_bytes
from placement.planning.graph_info import GraphInfo
from placement.planning.link_model import Link, LinksLike, resolve_links
from placement.planning.offload_search import gpu_activations, search_modes
from placement.planning.profile import profile
from placement.planning.speeds import DEFAULT_FLOPS

__all__ = ["plan_offload", "Layer", "OffloadPlan", "simulate", "MODES", "is_offload_budget", "layers_of"]

log = logging.getLogger(__name__)

MODES = ("resident", "streamed", "host")
#: Peak activation bytes on the GPU: a number, or a function of the layers' modes.
Activations = Union[int, Callable[[Sequence[str]], int]]

#: FLOP/s assumed to estimate a device's op times from another's (``throughput=``); the table
#: lives in :mod:`placement.planning.speeds`.
DEFAULT_THROUGHPUT = DEFAULT_FLOPS


@dataclass
class Layer:
    """A run of ops in graph order that is offloaded as one.

    Attributes:
        name: the block's module path (``"h.3"``), or the first op's name.
        start, end: its ops are positions ``start .. end-1`` of the graph order.
        params: weights it reads first (it owns them), in read order.
        param_bytes: bytes of ``params``.
        weights: every weight it reads (owned or not, e.g. a tied embedding) -> bytes.
        gpu_ns, host_ns: predicted compute time on the GPU and on the host.
        in_bytes, out_bytes: activation bytes it reads from earlier layers and that later
            layers read from it.
    """

    name: str
    start: int
    end: int
    params: list[str]
    param_bytes: int
    gpu_ns: int
    host_ns: int
    in_bytes: int
    out_bytes: int
    weights: dict[str, int] = field(default_factory=dict)


@dataclass
class OffloadPlan:
    """Per layer, where it runs and where its weights live; with the predicted time.

    Attributes:
        gpu, host: the two devices.
        layers: the layers in order.
        modes: layer name -> ``"resident"``, ``"streamed"`` or ``"host"``.
        window: prefetch window of streamed weights (bytes copied ahead of use).
        gpu_bytes: resident weights + twice the window (in use and in flight) + peak activations.
        host_bytes: weights living on the host.
        budgets: the GPU's and the host's budget (None: unlimited).
        predicted_ns: the simulated time of one forward.
        all_gpu_ns: the simulated time with every layer resident (ignoring the budget).
        copy_ns: the time the streamed weights take on the link per forward.
        link: the host -> GPU link planned with.
    """

    gpu: Device
    host: Device
    layers: list[Layer]
    modes: dict[str, str]
    window: int
    gpu_bytes: int
    host_bytes: int
    budgets: tuple[int | None, int | None]
    predicted_ns: int
    all_gpu_ns: int
    copy_ns: int
    link: Link = field(repr=False, default_factory=lambda: Link(1e10))

    @property
    def fits(self) -> bool:
        """Both budgets hold."""
        gpu_budget, host_budget = self.budgets
        return (gpu_budget is None or self.gpu_bytes <= gpu_budget) and (
            host_budget is None or self.host_bytes <= host_budget
        )

    def streamed_parameters(self) -> list[str]:
        """The weights that live on the host and stream to the GPU, in first-use order."""
        modes = [self.modes[layer.name] for layer in self.layers]
        return [name for per_layer in _streamed(self.layers, modes) for name in per_layer]

    def assignment(self, info: GraphInfo) -> dict[str, str]:
        """Op name -> device."""
        out: dict[str, str] = {}
        for layer in self.layers:
            device = self.host if self.modes[layer.name] == "host" else self.gpu
            for pos in range(layer.start, layer.end):
                out[info.names[pos]] = str(device)
        return out

    def __str__(self) -> str:
        counts = {mode: sum(1 for m in self.modes.values() if m == mode) for mode in MODES}
        return (
            f"offload plan: {counts['resident']} resident, {counts['streamed']} streamed, "
            f"{counts['host']} host layers; window {format_bytes(self.window)}; GPU "
            f"{format_bytes(self.gpu_bytes)} of {format_bytes(self.budgets[0])}; predicted "
            f"{self.predicted_ns / 1e6:.3f} ms (all on the GPU {self.all_gpu_ns / 1e6:.3f} ms)"
        )


def is_offload_budget(devices: Sequence[Device], budgets: Sequence[int | None]) -> bool:
    """True for exactly one GPU (with a budget) followed by one host device: what ``plan_offload`` plans."""
    return (
        len(devices) == 2
        and devices[0].type == "cuda"
        and devices[1].type == "cpu"
        and budgets[0] is not None
    )


_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def _layer_key(scope: str | None) -> str:
    """``h.3.attn.c_attn`` -> ``h.3``; ``model.layers.3.mlp`` -> ``model.layers.3``; ``lm_head`` -> itself."""
    if not scope:
        return ""
    match = _BLOCK.match(scope)
    if match:
        return match.group(1)
    return scope.split(".")[0]


def layers_of(model: Model, info: GraphInfo, gpu_ns: Sequence[int], host_ns: Sequence[int]) -> list[Layer]:
    """Cut the graph order into layers (see the module docstring); ops without parameters join the
    layer before them (the first layer: the one after)."""
    n = len(info)
    keys = [_layer_key(node_scope(node)) for node in info.nodes]
    runs: list[list[int]] = []  # [start, end]
    for pos in range(n):  # ops outside any module scope: each op with weights starts a layer
        same = bool(keys[pos]) and runs and keys[pos] == keys[runs[-1][0]]
        if runs and (same or not info.op_params[pos]):
            runs[-1][1] = pos + 1
        else:
            runs.append([pos, pos + 1])
    # a leading run without parameters joins the next one
    if len(runs) > 1 and not any(info.op_params[p] for p in range(*runs[0])):
        runs[1][0] = runs[0][0]
        runs.pop(0)
    owner: dict[int, int] = {}
    for k, (start, end) in enumerate(runs):
        for pos in range(start, end):
            for p in info.op_params[pos]:
                owner.setdefault(p, k)
    layers: list[Layer] = []
    for k, (start, end) in enumerate(runs):
        params = sorted((p for p, o in owner.items() if o == k), key=lambda p: p)
        floating = [p for p in params if _is_weight(model, info.param_names[p])]
        layers.append(
            Layer(
                name=keys[start] or info.names[start],
                start=start,
                end=end,
                params=[info.param_names[p] for p in floating],
                param_bytes=sum(info.param_bytes[p] for p in floating),
                gpu_ns=int(sum(gpu_ns[start:end])),
                host_ns=int(sum(host_ns[start:end])),
                in_bytes=info.segment_in_bytes(start, end),
                out_bytes=0,
                weights={
                    info.param_names[p]: info.param_bytes[p]
                    for pos in range(start, end)
                    for p in info.op_params[pos]
                    if _is_weight(model, info.param_names[p])
                },
            )
        )
    for k, layer in enumerate(layers):
        if k + 1 < len(layers):
            layer.out_bytes = layers[k + 1].in_bytes
    names: dict[str, int] = {}
    for layer in layers:  # unique names (a block read twice, root ops between blocks)
        seen = names.get(layer.name, 0)
        names[layer.name] = seen + 1
        if seen:
            layer.name = f"{layer.name}#{seen}"
    return layers


def _is_weight(model: Model, name: str) -> bool:
    value = model.graph.initializers[name].const_value
    return value is not None and value.dtype.is_floating_point() and len(value.shape) >= 1


def simulate(
    layers: Sequence[Layer],
    modes: Sequence[str],
    link: Link,
    back: Link | None = None,
    streamed: Sequence[Mapping[str, int]] | None = None,
) -> int:
    """Predicted nanoseconds of one forward (see the module docstring).

    The GPU runs resident and streamed layers in order; the copy stream copies streamed
    layers in order, the copy of a streamed layer starting once the previous streamed
    layer is in use (the window holds one layer ahead); a host layer after a GPU layer
    waits for its input on the host (``back``: the GPU -> host link) and a GPU layer after
    a host layer waits for its output.
    ``streamed``: per layer, the weights it streams in (default: its own, ``params``).

    Example:
        >>> a = Layer("a", 0, 1, ["w"], 10**6, 1000, 10**5, 0, 0, {"w": 10**6})
        >>> fast = Link(1e12)
        >>> simulate([a, a], ["resident", "streamed"], fast) < simulate([a, a], ["resident", "host"], fast)
        True
    """
    back = back or link
    if streamed is None:
        streamed = _streamed(layers, modes)
    t_gpu = 0  # when the GPU's compute stream is free
    t_copy = 0  # when the copy stream is free
    room = 0  # when the window has room for the next streamed layer
    for k, (layer, mode, weights) in enumerate(zip(layers, modes, streamed)):
        if mode == "resident":
            t_gpu += layer.gpu_ns
        elif mode == "streamed":
            start_copy = max(t_copy, room)
            t_copy = start_copy + sum(link.time_ns(size) for size in weights.values())
            start = max(t_gpu, t_copy)
            room = start  # in use now: the next streamed layer may be copied in
            t_gpu = start + layer.gpu_ns
        else:  # consecutive host layers hand activations over on the host (planner fix)
            copy_in = 0 if k and modes[k - 1] == "host" else back.time_ns(layer.in_bytes)
            copy_out = 0 if k + 1 < len(modes) and modes[k + 1] == "host" else link.time_ns(layer.out_bytes)
            t_gpu += copy_in + layer.host_ns + copy_out
    return t_gpu


def _spread(candidates: Sequence[int], m: int) -> list[int]:
    """``m`` of ``candidates`` spread evenly over them (interleaved with the others)."""
    if m >= len(candidates):
        return list(candidates)
    step = len(candidates) / m
    return sorted({candidates[min(len(candidates) - 1, int((i + 0.5) * step))] for i in range(m)})


def _streamed(layers: Sequence[Layer], modes: Sequence[str]) -> list[dict[str, int]]:
    """Per layer, the weights it streams in (name -> bytes): those it reads that no resident
    layer reads and no earlier streamed layer brought in (one copy per weight and device)."""
    resident = {name for layer, mode in zip(layers, modes) if mode == "resident" for name in layer.weights}
    seen: set[str] = set()
    out: list[dict[str, int]] = []
    for layer, mode in zip(layers, modes):
        mine: dict[str, int] = {}
        if mode == "streamed":
            for name, size in layer.weights.items():
                if name not in resident and name not in seen:
                    mine[name] = size
                    seen.add(name)
        out.append(mine)
    return out


def _memory(layers: Sequence[Layer], modes: Sequence[str], activations: Activations) -> tuple[int, int, int]:
    """(GPU bytes, host bytes, window) of an assignment of modes: the GPU holds the weights of
    resident layers, the largest streamed layer in use and one more in flight (twice the window)
    and the activations; the host holds every weight a streamed or host layer reads."""
    sizes = [sum(m.values()) for m in _streamed(layers, modes) if m]
    window = max(sizes, default=0)
    in_flight = window if len(sizes) == 1 else 2 * window  # one streamed layer: never two at once
    resident: dict[str, int] = {}
    hosted: dict[str, int] = {}
    for layer, mode in zip(layers, modes):
        (resident if mode == "resident" else hosted).update(layer.weights)
    if callable(activations):  # planner hook: the GPU's activations depend on the modes
        activations = activations(modes)
    return sum(resident.values()) + in_flight + activations, sum(hosted.values()), window


def _choose(
    layers: list[Layer],
    budgets: tuple[int | None, int | None],
    activations: Activations,
    link: Link,
    back: Link,
) -> tuple[list[str], int]:
    """The fastest feasible modes (see the module docstring) and their predicted time."""
    n = len(layers)
    gpu_budget, host_budget = budgets
    every = ["resident"] * n

    def fits(modes: list[str]) -> bool:
        gpu, host, _ = _memory(layers, modes, activations)
        return (gpu_budget is None or gpu <= gpu_budget) and (host_budget is None or host <= host_budget)

    if fits(every):
        return every, simulate(layers, every, link, back)
    candidates = [k for k, layer in enumerate(layers) if layer.weights]
    best: tuple[int, list[str]] | None = None
    for m in range(1, len(candidates) + 1):
        chosen = _spread(candidates, m)
        modes = list(every)
        for k in chosen:
            modes[k] = "streamed"
        # each layer taken off: stream it or run it on the host, whichever is faster
        for _ in range(2):
            for k in chosen:
                options = []
                for mode in ("streamed", "host"):
                    modes[k] = mode
                    options.append((simulate(layers, modes, link, back), mode == "host", mode))
                modes[k] = min(options)[2]
        if not fits(modes):
            host_only = ["host" if k in chosen else "resident" for k in range(n)]
            modes = host_only if fits(host_only) else modes
        if not fits(modes):
            continue
        t = simulate(layers, modes, link, back)
        if best is None or t < best[0]:
            best = (t, modes)
    if best is None:
        if callable(activations):  # planner hook: the GPU's activations depend on the modes
            activations = activations(every)
        smallest = activations + 2 * max((sum(layer.weights.values()) for layer in layers), default=0)
        raise InfeasiblePlacementError(
            f"no offload plan fits the budgets (GPU {format_bytes(gpu_budget)}, host "
            f"{format_bytes(host_budget)}): streaming needs at least {format_bytes(smallest)} on the GPU "
            "(peak activations and two layers' weights), and every weight must fit on the host"
        )
    return best[1], best[0]


def plan_offload(
    model: Model,
    max_memory: Mapping[Any, int | float | str],
    *,
    links: LinksLike = "auto",
    cost: str = "time",
    sample_inputs: Any = None,
    repeats: int = 3,
    op_times: Mapping[Any, Sequence[int] | Mapping[str, float]] | None = None,
    throughput: Mapping[str, float] | None = None,
    apply: bool = True,
) -> OffloadPlan:
    """Plan one GPU plus host memory: per layer resident, streamed or on the host (see the module doc).

    Args:
        model: the model (placed in place when ``apply``; it must have no copies yet).
        max_memory: exactly one GPU and one host device with budgets, ``{"cuda:0": "2GiB",
            "cpu": "48GiB"}`` or ``{0: ..., "cpu": ...}``; the host's may be left out (unlimited).
        links: the host <-> GPU link model (a preset such as ``"host"``, a
            :class:`~placement.planning.link_model.Link`, a mapping, or :func:`placement.measure_links`).
        cost: ``"time"`` (host op times measured here with ONNX Runtime) or ``"flops"``
            (every time from FLOPs and ``throughput``).
        sample_inputs: inputs for the timing (see :func:`placement.profile`).
        repeats: timed runs when profiling.
        op_times: measured op times (ns) per device, replacing the estimates: device ->
            a sequence in graph order (copies excluded) or op name -> ns.
        throughput: FLOP/s per device type (``{"cuda": 100e12, "cpu": 0.5e12}``), used
            for ``cost="flops"`` and to estimate the GPU's times from the host's.
        apply: place the model and mark its streamed parameters
            (:func:`placement.stream_parameters`, window included).

    Raises:
        PlanError: the budget is not one GPU plus a host, or bad arguments.
        InfeasiblePlacementError: no assignment fits.

    Example:
        >>> import os, tempfile
        >>> import placement as pl
        >>> from placement.models.synthetic import write_matmul_chain
        >>> path = os.path.join(tempfile.mkdtemp(), "chain.onnx")
        >>> weights = write_matmul_chain(path, layers=12, width=64)  # 12 x 16 KiB
        >>> opts = dict(cost="flops", throughput={"cuda": 1e10, "cpu": 1e8})
        >>> fast = pl.plan_offload(pl.load(path), {0: "140KiB"}, links=pl.Link(1e12), **opts)
        >>> slow = pl.plan_offload(pl.load(path), {0: "140KiB"}, links=pl.Link(1e7), **opts)
        >>> sorted(set(fast.modes.values())), sorted(set(slow.modes.values()))
        (['resident', 'streamed'], ['host', 'resident'])
    """
    from placement.passes.streaming import stream_parameters  # passes sit below planning
    from placement.planning.frontend import check_no_copies, transaction

    if cost not in ("time", "flops"):
        raise PlanError(f"plan_offload plans with cost='time' or 'flops', not {cost!r}")
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise PlanError(
            "plan_offload needs max_memory with one GPU and the host, e.g. {0: '2GiB', 'cpu': '48GiB'}"
        )
    parsed = {Device.parse(k): (parse_bytes(v) if v is not None else None) for k, v in max_memory.items()}
    gpus = [d for d in parsed if d.type == "cuda"]
    hosts = [d for d in parsed if d.type == "cpu"]
    if len(gpus) != 1 or len(hosts) > 1 or len(parsed) != len(gpus) + len(hosts):
        raise PlanError(
            f"plan_offload needs exactly one GPU and one host in max_memory, got {list(map(str, parsed))}"
        )
    gpu = gpus[0]
    host = hosts[0] if hosts else Device("cpu", 0)
    budgets = (parsed[gpu], parsed.get(host))
    if budgets[0] is None:
        raise PlanError(f"plan_offload needs a budget for {gpu}")
    check_no_copies(model, "plan_offload")
    link_model = resolve_links(links)
    to_gpu = link_model.link(host, gpu) if link_model is not None else Link(1e18)  # None: copies are free
    to_host = link_model.link(gpu, host) if link_model is not None else to_gpu
    rates = {**DEFAULT_THROUGHPUT, **(throughput or {})}
    prof = profile(model, sample_inputs=sample_inputs, time=cost == "time", repeats=repeats)
    info = GraphInfo(model)
    flops = prof.costs("flops")
    if cost == "time":
        host_ns = list(prof.costs("time"))
        gpu_ns = [round(t * rates["cpu"] / rates["cuda"]) for t in host_ns]
    else:
        host_ns = [round(f / rates["cpu"] * 1e9) for f in flops]
        gpu_ns = [round(f / rates["cuda"] * 1e9) for f in flops]
    for device, times in (op_times or {}).items():
        target = gpu_ns if Device.parse(device).type == "cuda" else host_ns
        if isinstance(times, Mapping):
            for name, value in times.items():
                if name not in info.position:
                    raise PlanError(f"op_times names op {name!r}, which is not in the model")
                target[info.position[name]] = round(value)
        else:
            if len(times) != len(info):
                raise PlanError(f"op_times[{device!r}] needs {len(info)} times, got {len(times)}")
            target[:] = [round(t) for t in times]
    layers = layers_of(model, info, gpu_ns, host_ns)
    # planner hooks (placement.planning.offload_search): the GPU holds the activations of the
    # ops it runs, and a local search improves the spread guess or finds a plan where it finds none
    activations = gpu_activations(info, layers)
    modes, predicted = search_modes(
        layers,
        budgets,
        lambda m: _memory(layers, m, activations),
        lambda m: simulate(layers, m, to_gpu, to_host),
        heuristic=lambda: _choose(layers, budgets, activations, to_gpu, to_host),
    )
    gpu_bytes, host_bytes, window = _memory(layers, modes, activations)
    plan = OffloadPlan(
        gpu=gpu,
        host=host,
        layers=layers,
        modes={layer.name: mode for layer, mode in zip(layers, modes)},
        window=window,
        gpu_bytes=gpu_bytes,
        host_bytes=host_bytes,
        budgets=budgets,
        predicted_ns=predicted,
        all_gpu_ns=simulate(layers, ["resident"] * len(layers), to_gpu, to_host),
        copy_ns=sum(
            to_gpu.time_ns(size) for per_layer in _streamed(layers, modes) for size in per_layer.values()
        ),
        link=to_gpu,
    )
    if apply:
        assignment = {name: Device.parse(dev) for name, dev in plan.assignment(info).items()}
        with transaction(model):
            for node in model.graph:
                set_node_device(node, assignment[node.name or ""])
        model.ir_model.metadata_props.pop(STREAMED_KEY, None)
        streamed = plan.streamed_parameters()
        if streamed:
            stream_parameters(model, streamed, host=host, window=window)
    log.info("plan_offload: %s", plan)
    return plan
