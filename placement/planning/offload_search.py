"""Choosing offload modes under both budgets: the GPU's activations, a local search, the error when none fits.

:func:`placement.plan_offload` gives every layer a mode (``resident``, ``streamed`` or
``host``). Its first guess spreads the layers taken off the GPU evenly over the order
(streamed copies then hide behind the resident layers' compute). This module makes that
choice hold up when the GPU budget is tight:

* :func:`gpu_activations`: the GPU holds the activations of the ops *it* runs (a liveness
  peak over the resident and streamed layers' ops, activations copied in included), not
  the whole model's: a plan whose large-activation layers (the logits of an LM head) run
  on the host needs less GPU memory, and an all-host plan needs none;
* :func:`search_modes`: from every starting plan that fits (:func:`starting_plans`: the
  spread guess, every layer on the host, greedy repairs of the all-resident and the
  all-streamed plans, a greedy fill by time saved per weight byte, and the caller's, such
  as the best plan of another window depth), a local search changes one layer's mode at a
  time, taking the change that shortens the simulated forward most and keeps both budgets;
  when none does, it swaps two layers (one towards the GPU, one away); when none does
  either, it *ejects* a GPU layer to the host and refills the memory it frees (a large layer
  traded for several smaller ones, several changes away through slower plans); until
  nothing is faster; the fastest result wins;
* :func:`infeasible_message`: when no plan fits, the error names both budgets and the
  smallest thing that does not fit (the weights on the host, the smallest layer on
  the GPU).

Everything here works on callables (``memory(modes)``, ``time(modes)``), so it knows
nothing of how memory and time are modelled. The cost model is not separable per layer (a
host layer's copies depend on its neighbours' modes, a streamed layer's stall on the copies
and window ``depth`` layers back, the GPU's activation peak on the whole split), so no exact
knapsack applies; on the six layers of the tiny GPT the search finds the best plan that an
exhaustive enumeration finds, at every budget tested.

Example:
    >>> from placement.planning.offload import Layer
    >>> a = Layer("a", 0, 1, ["w"], 100, 1, 50, 0, 0, {"w": 100})
    >>> b = Layer("b", 1, 2, ["v"], 100, 1, 50, 0, 0, {"v": 100})
    >>> memory = lambda m: (sum(100 for x in m if x == "resident"), sum(100 for x in m if x != "resident"), 0)
    >>> time = lambda m: sum(1 if x == "resident" else 50 for x in m)
    >>> search_modes([a, b], (150, None), memory, time)
    (['resident', 'host'], 51)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from placement.errors import InfeasiblePlacementError
from placement.graph.sizes import format_bytes

if TYPE_CHECKING:
    from placement.planning.graph_info import GraphInfo
    from placement.planning.offload_layers import Layer

__all__ = ["gpu_activations", "search_modes", "starting_plans", "infeasible_message"]

log = logging.getLogger(__name__)

_MODES = ("resident", "streamed", "host")
#: GPU layers an ejection tries (the largest first), and the distinct local optima of the starts
#: it runs from (the fastest first): they bound the search's cost on models with many layers.
EJECTIONS = 4
EJECTING_ENDS = 3
#: How much GPU memory a mode takes, least first.
_RANK = {"host": 0, "streamed": 1, "resident": 2}
Memory = Callable[[Sequence[str]], tuple[int, int, int]]
Time = Callable[[Sequence[str]], int]


def gpu_activations(info: GraphInfo, layers: Sequence[Layer]) -> Callable[[Sequence[str]], int]:
    """``modes -> bytes``: the liveness peak of the activations on the GPU when layers run as ``modes``.

    The GPU runs the ops of resident and streamed layers; activations copied in from a
    host layer count from the start of the GPU run that reads them (as
    :meth:`GraphInfo.peak_activations` counts a part's inputs). Memoised per
    host/GPU/streamed split. Load-time values made from a weight that streams (a streamed weight's
    transpose) are made on the GPU every step: they count as activations of streamed layers.

    Example:
        >>> import placement as pl
        >>> from placement.models import gpt
        >>> from placement.planning.graph_info import GraphInfo
        >>> from placement.planning.offload import layers_of
        >>> model = pl.from_torch(*gpt.build("tiny"))
        >>> info = GraphInfo(model)
        >>> layers = layers_of(model, info, [0] * len(info), [0] * len(info))
        >>> peak = gpu_activations(info, layers)
        >>> whole = info.segment_peak_activation(0, len(info))
        >>> peak(["host"] * len(layers)), peak(["resident"] * len(layers)) == whole
        (0, True)
    """
    cache: dict[tuple[tuple[bool, bool], ...], int] = {}
    # load-time values made from a weight that streams are made every step, on the GPU
    made_from: list[set[int]] = []
    for layer in layers:
        streamable = layer.streamable
        made_from.append(
            {
                b
                for b, sources in enumerate(info.blob_sources)
                if info.blob_fixed[b] and any(info.param_names[k] in streamable for k in sources)
            }
        )

    def peak(modes: Sequence[str]) -> int:
        key = tuple((mode == "host", mode == "streamed") for mode in modes)
        if key not in cache:
            if all(host for host, _ in key):
                cache[key] = 0
            else:
                part = [int(h) for layer, (h, _) in zip(layers, key) for _ in range(layer.start, layer.end)]
                per_step = set().union(*(blobs for blobs, (_, streamed) in zip(made_from, key) if streamed))
                cache[key] = info.peak_activations(part, 2, per_step=per_step)[0]
        return cache[key]

    return peak


def _fits(memory: Memory, budgets: tuple[int | None, int | None], modes: Sequence[str]) -> bool:
    gpu, host, _ = memory(modes)
    return (budgets[0] is None or gpu <= budgets[0]) and (budgets[1] is None or host <= budgets[1])


def _memo_fits(
    memory: Memory, budgets: tuple[int | None, int | None], floor: Memory | None = None
) -> Callable[[Sequence[str]], bool]:
    """``modes -> bool``: both budgets hold, memoised per plan; a plan whose ``floor`` (a cheap lower
    bound of ``memory``) is over a budget is rejected without ``memory``."""
    known: dict[tuple[str, ...], bool] = {}

    def fits(modes: Sequence[str]) -> bool:
        key = tuple(modes)
        if key not in known:
            known[key] = (floor is None or _fits(floor, budgets, modes)) and _fits(memory, budgets, modes)
        return known[key]

    return fits


def _memo_time(time: Time) -> Time:
    """``time``, memoised per plan (the starts' searches meet the same plans)."""
    known: dict[tuple[str, ...], int] = {}

    def memo(modes: Sequence[str]) -> int:
        key = tuple(modes)
        if key not in known:
            known[key] = time(modes)
        return known[key]

    return memo


def _alternatives(layer: Layer, mode: str) -> list[str]:
    """The modes ``layer`` can change to from ``mode`` (a layer without weights has nothing to stream)."""
    return [m for m in _MODES if m != mode and (m != "streamed" or layer.weights)]


def _moves(layers: Sequence[Layer], current: Sequence[str], pairs: bool) -> Iterator[list[str]]:
    """Every plan one layer's mode change away from ``current``; ``pairs``: every swap instead, one
    layer's change towards the GPU (more GPU memory) with another's away from it."""
    n = len(layers)
    for i in range(n):
        for mode in _alternatives(layers[i], current[i]):
            trial = list(current)
            trial[i] = mode
            if not pairs:
                yield trial
                continue
            up = _RANK[mode] > _RANK[current[i]]
            for j in range(i + 1, n):
                for other in _alternatives(layers[j], current[j]):
                    if (_RANK[other] > _RANK[current[j]]) == up:
                        continue
                    both = list(trial)
                    both[j] = other
                    yield both


def _best_move(
    layers: Sequence[Layer],
    current: Sequence[str],
    best: int,
    fits: Callable[[Sequence[str]], bool],
    time: Time,
    pairs: bool,
) -> tuple[list[str], int] | None:
    """The fastest plan a move away that is faster than ``best`` and fits (None: there is none)."""
    faster = []
    for order, trial in enumerate(_moves(layers, current, pairs)):
        t = time(trial)
        if t < best:
            faster.append((t, order, trial))
    for t, _, trial in sorted(faster):
        if fits(trial):
            return trial, t
    return None


def _eject(
    layers: Sequence[Layer],
    current: Sequence[str],
    best: int,
    fits: Callable[[Sequence[str]], bool],
    time: Time,
) -> tuple[list[str], int] | None:
    """The fastest plan made by sending one GPU layer to the host and refilling the GPU memory it
    frees (:func:`_fill`) that is faster than ``best`` (None: there is none). Reaches the plans
    several changes away that trade one large layer for several smaller ones (a knapsack's move).
    Only the :data:`EJECTIONS` GPU layers with the most weight bytes are tried (each try is a refill)."""
    found: tuple[list[str], int] | None = None
    on_gpu = [k for k, mode in enumerate(current) if mode != "host"]
    on_gpu.sort(key=lambda k: -_weight_bytes(layers[k], current[k]))
    for k in on_gpu[:EJECTIONS]:
        trial = list(current)
        trial[k] = "host"
        if not fits(trial):
            continue
        trial = _fill(layers, fits, time, start=trial, locked=k)
        t = time(trial)
        if t < (best if found is None else found[1]):
            found = (trial, t)
    return found


def _improve(
    layers: Sequence[Layer],
    modes: list[str],
    fits: Callable[[Sequence[str]], bool],
    time: Time,
    eject: bool = True,
) -> tuple[list[str], int]:
    """Local search: apply the one-layer mode change that shortens ``time`` most and fits; when none
    does, the best swap of two layers; when none does either (and ``eject``), the best
    :func:`_eject`; until nothing is faster."""
    current, best = list(modes), time(modes)
    while True:
        step = _best_move(layers, current, best, fits, time, False)
        if step is None:
            step = _best_move(layers, current, best, fits, time, True)
        if step is None and eject:
            step = _eject(layers, current, best, fits, time)
        if step is None:
            break
        current, best = step
    for k, mode in enumerate(current):  # a streamed layer that fits resident at no cost stops copying
        trial = list(current)
        trial[k] = "resident"
        if mode == "streamed" and time(trial) <= best and fits(trial):
            current, best = trial, time(trial)
    return current, best


def _repair(start: Sequence[str], memory: Memory, fits: Callable[[Sequence[str]], bool]) -> list[str]:
    """From ``start``, move to the host the layer that frees the most GPU bytes until the plan fits."""
    modes = list(start)
    while not fits(modes):
        options = []
        for k in range(len(modes)):
            if modes[k] == "host":
                continue
            trial = list(modes)
            trial[k] = "host"
            options.append((memory(trial)[0], k))
        if not options:
            break
        modes[min(options)[1]] = "host"
    return modes


def _weight_bytes(layer: Layer, mode: str) -> int:
    """The weight bytes ``layer`` keeps on the GPU in ``mode`` (its window share for a streamed one),
    to rank the changes :func:`_fill` considers; the budgets are checked on the whole plan."""
    if mode == "resident":
        return sum(layer.weights.values())
    if mode == "streamed":
        return sum(layer.weights.values()) + sum(layer.weights[name] for name in layer.shared)
    return 0


def _fill(
    layers: Sequence[Layer],
    fits: Callable[[Sequence[str]], bool],
    time: Time,
    start: Sequence[str] | None = None,
    locked: int | None = None,
) -> list[str]:
    """From ``start`` (default: every layer on the host), take the change towards the GPU (host to
    streamed or resident, streamed to resident) that saves the most time per weight byte it adds
    and fits, until none saves; layer ``locked`` keeps its mode. A change that does not fit is not
    tried again (the plan only grows)."""
    modes = list(start) if start is not None else ["host"] * len(layers)
    blocked: set[tuple[int, str]] = set()
    while True:
        now = time(modes)
        ranked = []
        for k, layer in enumerate(layers):
            for mode in _alternatives(layer, modes[k]):
                if k == locked or _RANK[mode] < _RANK[modes[k]] or (k, mode) in blocked:
                    continue
                trial = list(modes)
                trial[k] = mode
                saved = now - time(trial)
                if saved > 0:
                    added = max(_weight_bytes(layer, mode) - _weight_bytes(layer, modes[k]), 1)
                    ranked.append((-saved / added, k, mode, trial))
        for _, k, mode, trial in sorted(ranked, key=lambda r: r[:3]):
            if fits(trial):
                modes = trial
                break
            blocked.add((k, mode))
        else:
            return modes


def starting_plans(
    layers: Sequence[Layer],
    budgets: tuple[int | None, int | None],
    memory: Memory,
    time: Time,
    heuristic: Callable[[], tuple[list[str], int]] | None = None,
    starts: Sequence[Sequence[str]] = (),
    floor: Memory | None = None,
) -> dict[str, list[str]]:
    """The plans :func:`search_modes` starts from that fit both budgets, by name.

    ``spread``: the heuristic's guess; ``all host``; ``repaired all resident`` and ``repaired all
    streamed`` (layers go to the host, the one freeing the most GPU memory first, until the plan
    fits); ``fill by time per byte`` (:func:`_fill`); ``given k``: the caller's ``starts`` (the best
    plan of another window depth).

    Example:
        >>> from placement.planning.offload import Layer
        >>> a = Layer("a", 0, 1, ["w"], 100, 1, 50, 0, 0, {"w": 100})
        >>> memory = lambda m: (100 * m.count("resident"), 0, 0)
        >>> time = lambda m: sum(1 if x == "resident" else 50 for x in m)
        >>> starting_plans([a, a], (150, None), memory, time)["fill by time per byte"]
        ['resident', 'host']
    """
    fits = _memo_fits(memory, budgets, floor)
    return _starts(layers, memory, fits, _memo_time(time), heuristic, starts)


def _starts(
    layers: Sequence[Layer],
    memory: Memory,
    fits: Callable[[Sequence[str]], bool],
    time: Time,
    heuristic: Callable[[], tuple[list[str], int]] | None,
    starts: Sequence[Sequence[str]],
) -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    if heuristic is not None:
        try:
            named["spread"] = list(heuristic()[0])
        except InfeasiblePlacementError as err:
            log.info("offload search: the spread guess fits nothing (%s)", err)
    named["all host"] = ["host"] * len(layers)
    named["repaired all resident"] = _repair(["resident"] * len(layers), memory, fits)
    # every layer with weights streamed: reaches the plans that stream many layers through a
    # window, which one-layer changes from a resident-heavy plan cannot (they pass through slower plans)
    streamed = ["streamed" if layer.weights else "resident" for layer in layers]
    named["repaired all streamed"] = _repair(streamed, memory, fits)
    named["fill by time per byte"] = _fill(layers, fits, time)
    for k, start in enumerate(starts):
        if len(start) == len(layers):
            named[f"given {k}"] = list(start)
    return {name: modes for name, modes in named.items() if fits(modes)}


def search_modes(
    layers: Sequence[Layer],
    budgets: tuple[int | None, int | None],
    memory: Memory,
    time: Time,
    heuristic: Callable[[], tuple[list[str], int]] | None = None,
    starts: Sequence[Sequence[str]] = (),
    floor: Memory | None = None,
) -> tuple[list[str], int]:
    """The fastest modes found that fit both budgets, and their time (see the module docstring).

    Args:
        layers: the layers in graph order.
        budgets: the GPU's and the host's budget in bytes (None: unlimited).
        memory: ``modes -> (GPU bytes, host bytes, window)``.
        time: ``modes -> ns``, the simulated forward.
        heuristic: a first guess (``() -> (modes, ns)``); an
            :class:`~placement.errors.InfeasiblePlacementError` from it only drops it.
        starts: more plans to start from (the best of another window depth); those that do
            not fit are dropped.
        floor: a cheap lower bound of ``memory`` (the weights and a lower bound of the
            activations): plans over a budget by it alone are rejected without calling ``memory``.

    Raises:
        InfeasiblePlacementError: no starting plan fits; the message is
            :func:`infeasible_message`'s.
    """
    fits = _memo_fits(memory, budgets, floor)
    time = _memo_time(time)
    # single changes and swaps from every start, then ejections (the costly neighbourhood: a refill
    # per GPU layer) from each distinct plan they end in
    ends: dict[tuple[str, ...], str] = {}
    for name, start in _starts(layers, memory, fits, time, heuristic, starts).items():
        modes, t = _improve(layers, start, fits, time, eject=False)
        log.debug("offload search: from %s, %.3f ms", name, t / 1e6)
        ends.setdefault(tuple(modes), name)
    ranked = sorted(ends, key=time)
    results = [_improve(layers, list(modes), fits, time)[::-1] for modes in ranked[:EJECTING_ENDS]]
    results += [(time(modes), list(modes)) for modes in ranked[EJECTING_ENDS:]]
    if not results:
        raise InfeasiblePlacementError(infeasible_message(layers, budgets, memory))
    t, modes = min(results, key=lambda r: r[0])
    return modes, t


def infeasible_message(
    layers: Sequence[Layer], budgets: tuple[int | None, int | None], memory: Memory, gpu: str = "GPU"
) -> str:
    """Why no plan fits: both budgets, the weights the host would need, and the smallest layer on the GPU.

    Example:
        >>> from placement.planning.offload import Layer
        >>> a = Layer("h.0", 0, 1, ["w"], 100, 1, 50, 0, 0, {"w": 100})
        >>> memory = lambda m: (100 * m.count("resident"), 100 * (len(m) - m.count("resident")), 0)
        >>> print(infeasible_message([a, a], (50, 150), memory))  # doctest: +NORMALIZE_WHITESPACE
        no offload plan fits the budgets (GPU 50 B, host 150 B): every layer on the host
        needs 200 B of host memory, and the smallest layer to keep on the GPU, h.0, needs 100 B there
    """
    gpu_budget, host_budget = budgets
    everything_host = ["host"] * len(layers)
    host_need = memory(everything_host)[1]
    smallest: tuple[int, str] | None = None
    for k, layer in enumerate(layers):
        modes = list(everything_host)
        modes[k] = "resident"
        need = memory(modes)[0]
        if smallest is None or need < smallest[0]:
            smallest = (need, layer.name)
    text = (
        f"no offload plan fits the budgets ({gpu} {format_bytes(gpu_budget)}, "
        f"host {format_bytes(host_budget)}): every layer on the host needs "
        f"{format_bytes(host_need)} of host memory"
    )
    if smallest is not None:
        need, name = smallest
        text += f", and the smallest layer to keep on the GPU, {name}, needs {format_bytes(need)} there"
    return text
