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

The GPU budget counts the resident weights (a weight shared by several layers, such as a
tied embedding, once, on the GPU), the device window of streamed weights (``depth``
streamed layers in use and copied ahead, chosen with the modes), the peak of the
activations **at the batch planned for** (``batch=``, or the sample inputs' shapes) and a
workspace margin; the host budget counts the weights that live there. The mode is chosen
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
    >>> plan = pl.plan_offload(model, max_memory={0: "48KiB", "cpu": "1GiB"}, cost="flops", links="host")
    >>> plan.fits, sorted(set(plan.modes.values())) <= ["host", "resident", "streamed"]
    (True, True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from placement.errors import InfeasiblePlacementError, PlanError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import STREAMED_KEY, set_node_device
from placement.graph.sizes import format_bytes, parse_bytes
from placement.planning.dims import called_as, caller, planned_dims
from placement.planning.graph_info import GraphInfo, add_kv_cache
from placement.planning.link_model import Link, LinksLike, resolve_links
from placement.planning.offload_layers import Layer, aligned, layers_of
from placement.planning.offload_search import gpu_activations, search_modes
from placement.planning.profile import profile
from placement.planning.speeds import DEFAULT_FLOPS
from placement.planning.workspace import default_workspace

__all__ = [
    "plan_offload",
    "Layer",
    "OffloadPlan",
    "simulate",
    "MODES",
    "is_offload_budget",
    "layers_of",
    "default_workspace",
]

log = logging.getLogger(__name__)

MODES = ("resident", "streamed", "host")
#: Peak activation bytes on the GPU: a number, or a function of the layers' modes.
Activations = Union[int, Callable[[Sequence[str]], int]]


#: FLOP/s assumed to estimate a device's op times from another's (``throughput=``); the table
#: lives in :mod:`placement.planning.speeds`.
DEFAULT_THROUGHPUT = DEFAULT_FLOPS


@dataclass
class OffloadPlan:
    """Per layer, where it runs and where its weights live; with the predicted time.

    Attributes:
        gpu, host: the two devices.
        layers: the layers in order.
        modes: layer name -> ``"resident"``, ``"streamed"`` or ``"host"``.
        window: bytes of the device window holding the streamed weights in use and copied
            ahead (``depth`` of the largest streamed layer, plus its largest weight for the
            ring's wrap; :class:`~placement.runtime.torch.streaming.WeightStreamer`).
        gpu_bytes: resident weights (shared ones included) + the window + peak activations
            at the planned batch + the workspace margin.
        host_bytes: weights living on the host.
        budgets: the GPU's and the host's budget (None: unlimited).
        predicted_ns: the simulated time of one forward.
        all_gpu_ns: the simulated time with every layer resident (ignoring the budget).
        copy_ns: the time the streamed weights take on the link per forward.
        link: the host -> GPU link planned with.
        depth: streamed layers the window holds (in use and copied ahead).
        activation_bytes: peak live activations at the planned batch.
        workspace_bytes: the margin for the framework's workspace (cuBLAS, allocator rounding).
        bindings: the symbolic dimensions planned for (``{"batch": 8}``).
        kv_cache: the ``(batch, max_length)`` the KV caches are counted at (None: not counted);
            each layer's cache is on the device its ops run on (:attr:`Layer.state_bytes`), in
            ``gpu_bytes`` or ``host_bytes``.
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
    depth: int = 2
    activation_bytes: int = 0
    workspace_bytes: int = 0
    bindings: dict[str, int] = field(default_factory=dict)
    kv_cache: tuple[int, int] | None = None

    def kv_cache_bytes(self) -> tuple[int, int]:
        """KV cache bytes on the GPU and on the host."""
        on_host = [self.modes[layer.name] == "host" for layer in self.layers]
        gpu = sum(layer.state_bytes for layer, host in zip(self.layers, on_host) if not host)
        return gpu, sum(layer.state_bytes for layer in self.layers) - gpu

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
            f"{counts['host']} host layers; window {format_bytes(self.window)} ({self.depth} deep); GPU "
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


def simulate(
    layers: Sequence[Layer],
    modes: Sequence[str],
    link: Link,
    back: Link | None = None,
    streamed: Sequence[Mapping[str, int]] | None = None,
    *,
    depth: int = 2,
) -> int:
    """Predicted nanoseconds of one forward (see the module docstring).

    The GPU runs resident and streamed layers in order; the copy stream copies streamed
    layers in order, the copy of a streamed layer starting once the window has room:
    it holds ``depth`` streamed layers, so the copy of streamed layer ``j`` waits for the
    compute of streamed layer ``j - depth`` to end (its release). A host layer after a GPU
    layer waits for its input on the host (``back``: the GPU -> host link) and a GPU layer
    after a host layer waits for its output; consecutive host layers hand over on the host.
    ``streamed``: per layer, the weights it streams in (default: its own).

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
    finished: list[int] = []  # when each streamed layer's compute ended (its window room is free)
    for k, (layer, mode, weights) in enumerate(zip(layers, modes, streamed)):
        if mode == "resident":
            t_gpu += layer.gpu_ns
        elif mode == "streamed":
            room = finished[-depth] if depth >= 1 and len(finished) >= depth else 0
            t_copy = max(t_copy, room) + sum(link.time_ns(size) for size in weights.values())
            t_gpu = max(t_gpu, t_copy) + layer.gpu_ns
            finished.append(t_gpu)
        else:
            copy_in = 0 if k and modes[k - 1] == "host" else back.time_ns(layer.in_bytes)
            copy_out = 0 if k + 1 < len(modes) and modes[k + 1] == "host" else link.time_ns(layer.out_bytes)
            t_gpu += copy_in + layer.host_ns + copy_out
    return t_gpu


def _spread(candidates: Sequence[int], m: int) -> list[int]:
    """``m`` of ``candidates`` spread evenly over them (interleaved with the others: a streamed
    layer needs compute in front of it; the first candidate stays resident while ``m`` is at
    most half of them)."""
    if m >= len(candidates):
        return list(candidates)
    step = len(candidates) / m
    return sorted({candidates[min(len(candidates) - 1, int((i + 0.5) * step))] for i in range(m)})


def _streamed(layers: Sequence[Layer], modes: Sequence[str]) -> list[dict[str, int]]:
    """Per layer, the weights it streams in (name -> bytes): those only it reads (shared weights
    stay on the GPU), one copy per weight."""
    out: list[dict[str, int]] = []
    for layer, mode in zip(layers, modes):
        out.append(dict(layer.streamable) if mode == "streamed" else {})
    return out


def window_bytes(layers: Sequence[Layer], modes: Sequence[str], depth: int) -> int:
    """The device window the streamed layers need: ``depth`` of the largest streamed layer (each
    weight aligned as the runtime lays it out), plus the largest weight for the ring's wrap."""
    per_layer = [sum(aligned(size) for size in m.values()) for m in _streamed(layers, modes) if m]
    if not per_layer:
        return 0
    largest_weight = max(aligned(size) for m in _streamed(layers, modes) for size in m.values())
    return min(depth, len(per_layer)) * max(per_layer) + largest_weight


def _memory(
    layers: Sequence[Layer], modes: Sequence[str], activations: Activations, workspace: int, depth: int
) -> tuple[int, int, int]:
    """(GPU bytes, host bytes, window) of an assignment of modes: the GPU holds the weights of
    resident layers and the shared weights any GPU layer reads, the window, the peak activations
    of the ops it runs (``activations``: bytes, or a function of the modes), the KV caches of the
    layers it runs and the workspace; the host holds every weight a streamed or host layer reads
    and the KV caches of the host layers."""
    window = window_bytes(layers, modes, depth)
    resident: dict[str, int] = {}
    hosted: dict[str, int] = {}
    state = [0, 0]  # KV caches on the GPU, on the host
    for layer, mode in zip(layers, modes):
        state[mode == "host"] += layer.state_bytes
        if mode == "resident":
            resident.update(layer.weights)
        else:
            hosted.update(layer.weights)
            if mode == "streamed":
                resident.update({name: layer.weights[name] for name in layer.shared})
    if callable(activations):  # the GPU holds the activations of the ops it runs
        activations = activations(modes)
    gpu = sum(resident.values()) + window + activations + workspace + state[0]
    return gpu, sum(hosted.values()) + state[1], window


def _memory_floor(
    layers: Sequence[Layer], layer_peaks: Sequence[int], workspace: int, depth: int
) -> Callable[[Sequence[str]], tuple[int, int, int]]:
    """A cheap lower bound of :func:`_memory` (the search's ``floor``): the weights and window, and
    for the activations the largest of the GPU layers' own peaks (``layer_peaks``:
    :meth:`GraphInfo.segment_peak_activation` of each layer; the GPU's peak over its ops holds each)."""

    def floor(modes: Sequence[str]) -> tuple[int, int, int]:
        peak = max((p for p, mode in zip(layer_peaks, modes) if mode != "host"), default=0)
        return _memory(layers, modes, peak, workspace, depth)

    return floor


def _neighbours_streamed(modes: Sequence[str]) -> int:
    """How many pairs of neighbouring layers both stream (a streamed copy hides only behind the
    compute in front of it: among plans predicted equally fast, the interleaved one is preferred)."""
    return sum(1 for a, b in zip(modes, modes[1:]) if a == b == "streamed")


#: Plans predicted within this share of the fastest count as equally fast (see
#: :func:`_neighbours_streamed`).
TIE = 0.01


def _choose(
    layers: list[Layer],
    budgets: tuple[int | None, int | None],
    activations: Activations,
    workspace: int,
    link: Link,
    back: Link,
    depths: Sequence[int] = (1, 2, 3, 4),
) -> tuple[list[str], int, int]:
    """The fastest feasible modes (see the module docstring), their predicted time and window depth."""
    n = len(layers)
    gpu_budget, host_budget = budgets
    every = ["resident"] * n

    def fits(modes: list[str], depth: int) -> bool:
        gpu, host, _ = _memory(layers, modes, activations, workspace, depth)
        return (gpu_budget is None or gpu <= gpu_budget) and (host_budget is None or host <= host_budget)

    if fits(every, 1):
        return every, simulate(layers, every, link, back), 1
    # layers worth taking off: those whose own weights are a tenth of the largest layer's or more
    # (streaming a layer norm saves nothing and uses up a place in the interleaving)
    largest = max((sum(layer.streamable.values()) for layer in layers), default=0)
    candidates = [
        k
        for k, layer in enumerate(layers)
        if layer.streamable and 10 * sum(layer.streamable.values()) >= largest
    ]
    best: tuple[int, int, list[str], int] | None = None
    for m in range(1, len(candidates) + 1):
        chosen = _spread(candidates, m)
        for depth in depths:
            modes = list(every)
            for k in chosen:
                modes[k] = "streamed"
            # each layer taken off: stream it or run it on the host, whichever is faster
            for _ in range(2):
                for k in chosen:
                    options = []
                    for mode in ("streamed", "host"):
                        modes[k] = mode
                        options.append(
                            (simulate(layers, modes, link, back, depth=depth), mode == "host", mode)
                        )
                    modes[k] = min(options)[2]
            if not fits(modes, depth):
                host_only = ["host" if k in chosen else "resident" for k in range(n)]
                modes = host_only if fits(host_only, depth) else modes
            if not fits(modes, depth):
                continue
            t = simulate(layers, modes, link, back, depth=depth)
            if best is None or (t, -depth) < (best[0], -best[1]):
                best = (t, depth, modes, m)
    if best is None:
        if callable(activations):
            activations = activations(every)
        fixed = activations + workspace
        cache = sum(layer.state_bytes for layer in layers)
        held = f", and the KV caches ({format_bytes(cache)} in all) where their layers run" if cache else ""
        raise InfeasiblePlacementError(
            f"no offload plan fits the budgets (GPU {format_bytes(gpu_budget)}, host "
            f"{format_bytes(host_budget)}): streaming needs at least {format_bytes(fixed + largest)} on "
            f"the GPU (peak activations and workspace {format_bytes(fixed)}, and the largest layer's "
            f"weights), and every weight must fit on the host{held}"
        )
    return best[2], best[0], best[1]


def _search(
    layers: list[Layer],
    budgets: tuple[int | None, int | None],
    activations: Activations,
    workspace_bytes: int,
    to_gpu: Link,
    to_host: Link,
    layer_peaks: Sequence[int],
) -> tuple[int, list[str], int]:
    """(predicted ns, modes, window depth) of the plan :func:`plan_offload` takes (``layer_peaks``:
    see :func:`_memory_floor`)."""
    # for each window depth, the spread guess and a local search (placement.planning.offload_search)
    # from it, the other starts there and the best plan of the depths before; the fastest fit wins,
    # interleaved plans first among equally fast ones
    found: list[tuple[int, list[str], int]] = []
    for depth in (1, 2, 3, 4):
        # the spread guess: a candidate itself, and the first start of the search
        guess: tuple[list[str], int] | None = None
        try:
            spread, t, _ = _choose(
                layers, budgets, activations, workspace_bytes, to_gpu, to_host, depths=(depth,)
            )
            guess = (spread, t)
            found.append((t, spread, depth))
        except InfeasiblePlacementError:
            pass
        try:
            modes, predicted = search_modes(
                layers,
                budgets,
                lambda m, d=depth: _memory(layers, m, activations, workspace_bytes, d),
                lambda m, d=depth: simulate(layers, m, to_gpu, to_host, depth=d),
                heuristic=None if guess is None else (lambda g=guess: g),
                starts=[min(found)[1]] if found else (),  # the best plan of the depths before
                floor=_memory_floor(layers, layer_peaks, workspace_bytes, depth),
            )
        except InfeasiblePlacementError:
            if depth == 4 and not found:
                raise
            continue
        found.append((predicted, modes, depth))
    fastest = min(t for t, _, _ in found)
    predicted, modes, depth = min(
        (f for f in found if f[0] <= fastest * (1 + TIE)),
        key=lambda f: (_neighbours_streamed(f[1]), f[0], -f[2]),
    )
    return predicted, modes, depth


def _feeds(model: Model, sample_inputs: Any) -> dict[str, Any] | None:
    """Graph input name -> array of the sample inputs (None when there are none)."""
    if sample_inputs is None:
        return None
    from placement.planning.profile import _normalise_inputs

    return _normalise_inputs(model, sample_inputs)


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
    batch: int | Mapping[str, int] | None = None,
    workspace: int | str | None = None,
    kv_cache: tuple[int, int] | None = None,
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
        batch: the batch the plan is made for: symbolic dimensions of the graph inputs that
            ``sample_inputs`` do not give are bound to it (an int), or as a mapping names
            (``{"batch": 8, "seq": 128}``); default 1 (see :mod:`placement.planning.dims`),
            so the activations counted in the GPU budget are those of that batch.
        workspace: bytes kept free on the GPU for the framework's workspace (cuBLAS's
            workspace, the allocator's rounding); default :func:`default_workspace`: cuBLAS's
            32 MiB where the budget is at least 64 MiB (at most half of it), else
            :data:`WORKSPACE_SHARE` of a toy budget.
        kv_cache: ``(batch, max_length)`` for a model with a KV cache
            (:func:`placement.from_causal_lm`): each layer's cache at that batch and length is
            counted on the device its layer runs on (the GPU for resident and streamed layers,
            the host for host layers), as :func:`placement.auto_place` does.

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
    feeds = _feeds(model, sample_inputs)
    bindings = planned_dims(model, sample_inputs=feeds, batch=batch)
    with called_as(caller() if caller() != "profile" else "plan_offload"):
        prof = profile(model, sample_inputs=feeds, time=cost == "time", repeats=repeats, dims=bindings)
    info = GraphInfo(model, dims=bindings)
    if kv_cache is not None:
        add_kv_cache(info, model, kv_cache)
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
    activations = gpu_activations(info, layers)  # the GPU holds the activations of the ops it runs
    if workspace is None:
        workspace_bytes = default_workspace(budgets[0])
    else:
        workspace_bytes = parse_bytes(workspace)
    peaks = [info.segment_peak_activation(layer.start, layer.end) for layer in layers]
    predicted, modes, depth = _search(layers, budgets, activations, workspace_bytes, to_gpu, to_host, peaks)
    gpu_bytes, host_bytes, window = _memory(layers, modes, activations, workspace_bytes, depth)
    peak_activations = activations(modes)
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
        depth=depth,
        activation_bytes=peak_activations,
        workspace_bytes=workspace_bytes,
        bindings=bindings,
        kv_cache=None if kv_cache is None else (int(kv_cache[0]), int(kv_cache[1])),
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
