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

Communication (``cost="time"``): a link model (:mod:`placement.planning.links`, by
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

import bisect
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from placement.errors import InfeasiblePlacementError, PlanError, UnknownOpError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model
from placement.graph.nodes import STREAM_WINDOW_KEY, STREAMED_KEY, set_node_device
from placement.graph.sizes import format_bytes, parse_bytes
from placement.planning.frontend import check_no_copies, transaction
from placement.planning.links import Link, Links, LinksLike, resolve_links
from placement.planning.offload import is_offload_budget
from placement.planning.profile import COST_KINDS, GraphInfo, fingerprint, profile

__all__ = [
    "Plan",
    "auto_place",
    "parse_bytes",
    "format_bytes",
    "partition_costs",
    "constant_glue",
    "PartitionProblem",
]

log = logging.getLogger(__name__)

OBJECTIVES = ("throughput", "latency")
#: What ``auto_place(runtime=...)`` balances a plan for.
RUNTIMES = ("ort", "torch")


def _format_cost(value: float, kind: str) -> str:
    if kind == "time":
        return f"{value / 1e6:.3f} ms"
    if kind == "size":
        return format_bytes(value)
    return f"{value / 1e6:.2f} MFLOP"


# --- the exact partitioner ------------------------------------------------------------


class PartitionProblem:
    """Contiguous partition of ``n`` ops into ``len(budgets)`` ordered parts.

    The cost of part ``k`` running ops ``i..j-1`` is the sum of their op costs, plus,
    when ``links_in`` is given, the time to copy into it every distinct blob it reads
    that was made (or fed) before ``i`` (``links_in[k].time_ns(bytes)`` per blob: one
    latency per copy), plus, when ``cut_costs`` is given, ``cut_costs[i][1]`` and
    ``cut_costs[j][0]`` (what a cut at ``i`` costs the part after it and a cut at ``j``
    the part before it; empty parts cost nothing).

    Args:
        costs: integer cost per op (non-negative).
        budgets: per part, a memory budget in bytes or None (unlimited).
        info: the graph tables (needed for memory and transfers; None for pure costs).
        allowed_cuts: ``n + 1`` flags; a part may end at position ``j`` only where
            ``allowed_cuts[j]`` (0 and ``n`` always may). Restricting cut points keeps
            every algorithm exact over the partitions that remain.
        links_in: per part, the link its incoming copies travel on (needs ``info``).
        cut_costs: ``n + 1`` pairs ``(before, after)`` of non-negative integers.
    """

    def __init__(
        self,
        costs: Sequence[int],
        budgets: Sequence[int | None],
        info: GraphInfo | None = None,
        *,
        allowed_cuts: Sequence[bool] | None = None,
        links_in: Sequence[Link] | None = None,
        cut_costs: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        if any(c < 0 for c in costs):
            raise PlanError("op costs must be non-negative")
        if not budgets:
            raise PlanError("need at least one device")
        self.n = len(costs)
        self.costs = [int(c) for c in costs]
        self.prefix = [0]
        for c in self.costs:
            self.prefix.append(self.prefix[-1] + c)
        self.budgets = list(budgets)
        self.info = info
        allowed = [True] * (self.n + 1) if allowed_cuts is None else [bool(a) for a in allowed_cuts]
        if len(allowed) != self.n + 1:
            raise PlanError(f"allowed_cuts needs {self.n + 1} entries, got {len(allowed)}")
        allowed[0] = allowed[self.n] = True
        self.allowed = allowed
        self._floor = [0] * (self.n + 1)  # the largest allowed cut position <= j
        for j in range(self.n + 1):
            self._floor[j] = j if allowed[j] else self._floor[j - 1]
        self._reach: dict[int, dict[int, int]] = {}
        self._mem: dict[tuple[int, int], int] = {}
        if info is None and any(b is not None for b in budgets):
            raise PlanError("memory budgets need graph tables")
        if links_in is not None:
            if info is None:
                raise PlanError("link costs need graph tables")
            if len(links_in) != len(self.budgets):
                raise PlanError(
                    f"links_in needs one link per part ({len(self.budgets)}), got {len(links_in)}"
                )
        self.links_in = list(links_in) if links_in is not None else None
        self.cut_before = [0] * (self.n + 1)  # charged to the part ending at the position
        self.cut_after = [0] * (self.n + 1)  # charged to the part starting there
        if cut_costs is not None:
            if len(cut_costs) != self.n + 1:
                raise PlanError(f"cut_costs needs {self.n + 1} entries, got {len(cut_costs)}")
            if any(a < 0 or b < 0 for a, b in cut_costs):
                raise PlanError("cut costs must be non-negative")
            for c in range(1, self.n):
                self.cut_before[c], self.cut_after[c] = (int(x) for x in cut_costs[c])
        self.simple = self.links_in is None and not any(self.cut_before) and not any(self.cut_after)

    @property
    def parts(self) -> int:
        return len(self.budgets)

    def cost(self, i: int, j: int) -> int:
        return self.prefix[j] - self.prefix[i]

    def memory(self, i: int, j: int) -> int:
        """Parameters plus peak activations of ops ``i..j-1`` (memoised)."""
        key = (i, j)
        value = self._mem.get(key)
        if value is None:
            assert self.info is not None
            value = self.info.segment_memory(i, j) if j > i else 0
            self._mem[key] = value
        return value

    def memory_reach(self, budget: int | None, i: int) -> int:
        """The largest ``j`` such that ops ``i..j-1`` fit in ``budget`` (memory is monotone)."""
        if budget is None:
            return self.n
        cache = self._reach.setdefault(budget, {})
        hit = cache.get(i)
        if hit is not None:
            return hit
        if self.memory(i, min(i + 1, self.n)) > budget:
            cache[i] = i
            return i
        lo, step = min(i + 1, self.n), 1  # lo fits
        while lo < self.n:
            hi = min(self.n, lo + step)
            if self.memory(i, hi) <= budget:
                lo, step = hi, step * 2
            else:
                break
        else:
            cache[i] = self.n
            return self.n
        # lo fits, lo+step does not (or is past n): binary search in between
        hi = min(self.n, lo + step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.memory(i, mid) <= budget:
                lo = mid
            else:
                hi = mid
        cache[i] = lo
        return lo

    def cost_reach(self, i: int, bound: int) -> int:
        """The largest ``j`` with ``cost(i, j) <= bound``."""
        return bisect.bisect_right(self.prefix, self.prefix[i] + bound) - 1

    def segments(self, k: int, i: int, bound: int | None) -> Any:
        """Yield ``(j, part cost, overhead, bytes in)`` for every allowed end ``j > i`` of
        part ``k`` starting at ``i`` that fits its budget and whose op costs alone stay
        within ``bound``. ``overhead`` is the part cost minus its op costs."""
        info = self.info
        jmax = self.memory_reach(self.budgets[k], i)
        if bound is not None:
            jmax = min(jmax, self.cost_reach(i, bound))
        link = self.links_in[k] if self.links_in is not None else None
        start = self.cut_after[i]
        seen: set[int] = set()
        in_bytes = in_time = 0
        prefix_i = self.prefix[i]
        for j in range(i + 1, jmax + 1):
            if info is not None:
                for b in info.op_inputs[j - 1]:
                    if b in seen:
                        continue
                    producer = info.blob_producer[b]
                    first = producer if producer >= 0 else info.blob_consumers[b][0]
                    if first < i:
                        seen.add(b)
                        size = info.step_bytes[b]
                        in_bytes += size
                        if link is not None:
                            in_time += link.time_ns(size)
            if not self.allowed[j]:
                continue
            overhead = in_time + start + self.cut_before[j]
            yield j, self.prefix[j] - prefix_i + overhead, overhead, in_bytes

    def segment_cost(self, k: int, i: int, j: int) -> int:
        """The cost of part ``k`` running ops ``i..j-1`` (class docstring)."""
        if j <= i:
            return 0
        cost = self.cost(i, j) + self.cut_after[i] + self.cut_before[j]
        if self.links_in is not None:
            assert self.info is not None
            link = self.links_in[k]
            cost += sum(link.time_ns(self.info.step_bytes[b]) for b in self.info.blobs_into(i, j))
        return cost

    def greedy(self, bound: int, budgets: Sequence[int | None] | None = None) -> list[int] | None:
        """Ends of the parts if every part's op costs can stay within ``bound``, else None."""
        budgets = self.budgets if budgets is None else budgets
        i = 0
        ends = []
        for budget in budgets:
            j = self._floor[min(self.cost_reach(i, bound), self.memory_reach(budget, i))]
            ends.append(j)
            i = j
        return ends if i == self.n else None

    def min_bottleneck(self) -> int:
        """The smallest achievable bottleneck (the largest part cost), exactly.

        Op costs alone: integer bisection over greedy sweeps (a part's cost can only
        shrink with the part). With links or cut costs a part can cost more when it
        starts later (a blob made just before it must now be copied in), so the
        exchange argument behind the greedy sweep fails; a min-max dynamic programme
        over cut points (exact by optimal substructure) is used instead.

        Raises:
            InfeasiblePlacementError: the budgets cannot hold the model at all.
        """
        total = self.prefix[-1]
        if self.greedy(total) is None:
            raise InfeasiblePlacementError(self.infeasible_message())
        plain = self._min_op_bottleneck()
        return plain if self.simple else self._min_max(plain)

    def _min_op_bottleneck(self) -> int:
        """The smallest bottleneck of op costs alone (integer bisection over greedy sweeps)."""
        total = self.prefix[-1]
        lo = max(max(self.costs, default=0), -(-total // self.parts))
        hi = total
        if lo > hi:
            lo = hi
        while lo < hi:
            mid = (lo + hi) // 2
            if self.greedy(mid) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _min_max(self, plain: int) -> int:
        n = self.n
        inf = math.inf
        # any feasible partition bounds the optimum from above (the one optimal for op
        # costs alone is a good one); the bound limits how far a part may reach, since a
        # part's cost is at least its op costs
        upper: float = inf
        ends = self.greedy(plain)
        if ends is not None:
            start, worst = 0, 0
            for k, end in enumerate(ends):
                worst = max(worst, self.segment_cost(k, start, end))
                start = end
            upper = worst
        best: list[float] = [0] + [inf] * n
        for k in range(self.parts):
            new = list(best)  # an empty part keeps the position
            for i in range(n):
                base = best[i]
                if base == inf or base > upper:
                    continue
                for j, cost, _, _ in self.segments(k, i, int(upper)):
                    cand = max(base, cost)
                    if cand < new[j]:
                        new[j] = cand
            best = new
        if best[n] == inf:
            raise InfeasiblePlacementError(self.infeasible_message())
        return int(best[n])

    def min_transfer(self, bound: int | None) -> list[int]:
        """Part ends minimising (overhead per step, bottleneck), every part within ``bound``.

        The overhead is the bytes copied per step when only op costs count, else the
        summed part costs beyond op costs (transfer times and cut costs). Exact dynamic
        programme over cut points; part ``k`` must fit its budget.
        """
        n = self.n
        inf = (math.inf, math.inf)
        best: list[tuple[float, float]] = [(0, 0)] + [inf] * n
        parents: list[list[int]] = []
        for k in range(self.parts):
            new = list(best)  # an empty part keeps the position
            parent = list(range(n + 1))
            for i in range(n):
                base = best[i]
                if base == inf:
                    continue
                for j, cost, overhead, in_bytes in self.segments(k, i, bound):
                    if bound is not None and cost > bound:
                        continue
                    cand = (base[0] + (in_bytes if self.simple else overhead), max(base[1], cost))
                    if cand < new[j]:
                        new[j] = cand
                        parent[j] = i
            best = new
            parents.append(parent)
        if best[n] == inf:
            raise InfeasiblePlacementError(self.infeasible_message())
        ends = []
        j = n
        for parent in reversed(parents):
            ends.append(j)
            j = parent[j]
        return list(reversed(ends))

    def min_uniform_budget(self) -> int:
        """The smallest budget that, given to every part, admits a placement (exact)."""
        assert self.info is not None
        total = self.prefix[-1]
        lo = max((self.memory(i, i + 1) for i in range(self.n)), default=0)
        hi = self.memory(0, self.n)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.greedy(total, [mid] * self.parts) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def infeasible_message(self) -> str:
        largest_op = max(range(self.n), key=lambda i: self.memory(i, i + 1)) if self.n else 0
        need = self.memory(largest_op, largest_op + 1) if self.n else 0
        uniform = self.min_uniform_budget()
        budgets = ", ".join(format_bytes(b) if b is not None else "unlimited" for b in self.budgets)
        name = self.info.names[largest_op] if self.info is not None and self.n else "?"
        return (
            f"no contiguous placement of {self.n} ops on {self.parts} devices fits the budgets "
            f"[{budgets}]: it needs at least {format_bytes(need)} on some device (op {name!r} "
            f"alone), and the smallest uniform budget that fits is {format_bytes(uniform)} "
            f"({uniform} bytes) per device"
        )


def constant_glue(info: GraphInfo) -> list[bool]:
    """Allowed cut points: never right after an op that depends on no graph input.

    Such ops (weight transposes, shape arithmetic, masks) compute from parameters
    alone: load-time values, folded where they are read. The exporter emits each right
    before its reader, so a cut right after one would split it from its reader (and
    count its cost on the wrong device); each stays with the op after it.
    """
    return [True] + [info.data_dependent[pos] for pos in range(len(info))]


def partition_costs(costs: Sequence[int], parts: int, *, nonempty: bool = True) -> list[int]:
    """Sizes of an exact min-bottleneck contiguous partition of ``costs`` into ``parts``.

    With ``nonempty`` (and at least ``parts`` items) every part gets one item or more
    without raising the bottleneck (torchgpipe's balance lists are positive).

    Example:
        >>> partition_costs([1, 2, 3, 4, 5, 6], 3)
        [3, 2, 1]
        >>> partition_costs([1, 1, 10], 3)
        [1, 1, 1]
    """
    if parts < 1:
        raise PlanError(f"need at least one partition, got {parts}")
    problem = PartitionProblem(costs, [None] * parts)
    ends = problem.greedy(problem.min_bottleneck())
    assert ends is not None
    if nonempty and len(costs) >= parts:
        fixed = list(ends)
        for k in range(parts - 2, -1, -1):
            fixed[k] = min(fixed[k], fixed[k + 1] - 1)
        ends = fixed
    sizes, start = [], 0
    for end in ends:
        sizes.append(end - start)
        start = end
    return sizes


# --- plans ------------------------------------------------------------------------------


@dataclass
class DevicePlan:
    """Predicted figures of one device under a plan.

    Attributes:
        device: the device (string).
        ops: number of ops.
        first_op / last_op: the part's first and last op (None if empty).
        cost: summed op cost (ns, bytes or FLOPs, per ``Plan.cost_kind``).
        param_bytes: parameters it holds (shared ones count on every device reading them).
        activation_bytes: liveness-based peak of its activations.
        budget: its memory budget in bytes, or None.
        bytes_in / bytes_out: bytes copied in and out per step.
        transfer_time: nanoseconds to copy its inputs in per step under the link model
            (0 without one).
        cut_cost: nanoseconds its cuts cost it (fusions lost at a cut; 0 without).
    """

    device: str
    ops: int
    first_op: str | None
    last_op: str | None
    cost: int
    param_bytes: int
    activation_bytes: int
    budget: int | None
    bytes_in: int
    bytes_out: int
    transfer_time: int = 0
    cut_cost: int = 0

    @property
    def stage_cost(self) -> int:
        """What the planner minimises the largest of: op costs, transfers in, cut costs."""
        return self.cost + self.transfer_time + self.cut_cost

    @property
    def memory(self) -> int:
        """Parameters plus peak activations."""
        return self.param_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        """True if the device's memory stays within its budget."""
        return self.budget is None or self.memory <= self.budget


@dataclass
class Plan:
    """A placement plan: the device of every op plus its predicted cost and memory.

    Plans can be applied (:meth:`apply`), printed (``str(plan)`` is a table), saved
    (:meth:`save`, :meth:`to_json`) and loaded (:meth:`load`, :meth:`from_json`).

    Attributes:
        assignment: op name -> device string, in graph order.
        devices: per-device predictions (:class:`DevicePlan`), in part order.
        cost_kind: ``"time"`` (ns), ``"size"`` (bytes) or ``"flops"``.
        objective: ``"throughput"`` or ``"latency"``.
        bottleneck: the largest per-device :attr:`DevicePlan.stage_cost`.
        lower_bound: ``max(ceil(total / N), largest op)``, no plan can beat it.
        total_cost: sum of all op costs.
        transfer_bytes: bytes copied between devices per step.
        cut_bytes: per boundary between consecutive used devices, bytes of the
            distinct blobs crossing it.
        fingerprint: structure fingerprint of the model planned for.
        overhead: per step, the summed transfer times and cut costs (ns; 0 without a
            link model or cut costs): what the latency objective minimises.
        links: the link model planned with (see :meth:`Links.to_dict`), or None.
        runtime: the executor the op times were taken for (``auto_place(runtime=...)``):
            ``"ort"`` or ``"torch"``.
        streamed: parameters that live on the host and stream to the GPU that reads
            them (parameter -> host device; see :func:`placement.plan_offload`).
        stream_window: bytes of streamed weights copied ahead of use, or None.
    """

    assignment: dict[str, str]
    devices: list[DevicePlan]
    cost_kind: str
    objective: str
    bottleneck: int
    lower_bound: int
    total_cost: int
    transfer_bytes: int
    cut_bytes: list[int] = field(default_factory=list)
    fingerprint: str = ""
    overhead: int = 0
    links: dict[str, Any] | None = None
    runtime: str = "ort"
    streamed: dict[str, str] = field(default_factory=dict)
    stream_window: int | None = None

    @property
    def ratio(self) -> float:
        """``bottleneck / lower_bound`` (1.0 is provably optimal)."""
        return self.bottleneck / self.lower_bound if self.lower_bound else 1.0

    @property
    def fits(self) -> bool:
        """True if every device stays within its budget."""
        return all(d.fits for d in self.devices)

    def device_of(self, op: str) -> Device:
        """The device the plan gives ``op``."""
        try:
            return Device.parse(self.assignment[op])
        except KeyError:
            raise UnknownOpError(f"the plan has no op {op!r}") from None

    def apply(self, model: Model) -> None:
        """Place ``model``'s ops as planned, in place (transactional).

        Raises:
            UnknownOpError: the plan names an op the model lacks.
            PlanError: the model has ops the plan does not cover, or copies.
        """
        check_no_copies(model, "Plan.apply")
        names = {node.name for node in model.graph}
        for op in self.assignment:
            if op not in names:
                raise UnknownOpError(f"the plan places op {op!r}, which is not in the model")
        missing = [n for n in names if n not in self.assignment]
        if missing:
            raise PlanError(f"the plan does not cover op {missing[0]!r} ({len(missing)} ops missing)")
        if self.fingerprint and fingerprint(model) != self.fingerprint:
            log.warning("applying a plan made for a different model structure")
        parsed = {op: Device.parse(dev) for op, dev in self.assignment.items()}
        with transaction(model):
            for node in model.graph:
                set_node_device(node, parsed[node.name or ""])
        if self.streamed:  # the plan keeps these weights on the host (see plan_offload)
            props = model.ir_model.metadata_props
            props[STREAMED_KEY] = json.dumps(self.streamed)
            if self.stream_window is not None:
                props[STREAM_WINDOW_KEY] = str(self.stream_window)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    def to_json(self, *, indent: int | None = 1) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output.

        Raises:
            PlanError: the data is not a plan.
        """
        try:
            fields = dict(data)
            fields["devices"] = [DevicePlan(**d) for d in fields["devices"]]
            fields["assignment"] = {str(k): str(v) for k, v in fields["assignment"].items()}
            for dev in fields["assignment"].values():
                Device.parse(dev)
            return cls(**fields)
        except (TypeError, KeyError, AttributeError, ValueError) as err:
            raise PlanError(f"not a placement plan: {err}") from err

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuild a plan from :meth:`to_json` text."""
        try:
            data = json.loads(text)
        except ValueError as err:
            raise PlanError(f"plan JSON does not parse: {err}") from err
        if not isinstance(data, dict):
            raise PlanError("plan JSON must be an object")
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON, atomically: a failure leaves an existing file as it was.

        Raises:
            PlanError: the file cannot be written (the message names it).
        """
        from placement.graph.atomic import write_atomic

        try:
            write_atomic(path, self.to_json().encode("utf-8"), what="plan")
        except (OSError, TypeError, ValueError) as err:
            raise PlanError(f"cannot save plan to {str(path)!r}: {err}") from err

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by :meth:`save`.

        Raises:
            PlanError: the file is missing or not a plan.
        """
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise PlanError(f"cannot read plan {str(path)!r}: {err}") from err
        except UnicodeDecodeError as err:
            raise PlanError(f"{str(path)!r} is not a placement plan (not UTF-8 text: {err.reason})") from err
        try:
            return cls.from_json(text)
        except PlanError as err:
            raise PlanError(f"{str(path)!r}: {err}") from err

    def to_table(self) -> Any:
        """A ``rich.table.Table`` with one row per device."""
        from rich.table import Table

        table = Table(
            title=(
                f"plan ({self.objective}, cost={self.cost_kind}): bottleneck "
                f"{_format_cost(self.bottleneck, self.cost_kind)} = {self.ratio:.3f} x lower bound, "
                f"{format_bytes(self.transfer_bytes)} copied per step"
            )
        )
        for col in (
            "device",
            "ops",
            "first op",
            "last op",
            "cost",
            "params",
            "peak act.",
            "budget",
            "in",
            "out",
            *(("transfers", "cut cost") if self.links is not None or self.overhead else ()),
        ):
            table.add_column(col, justify="left" if col in ("device", "first op", "last op") else "right")
        for d in self.devices:
            table.add_row(
                d.device,
                str(d.ops),
                d.first_op or "-",
                d.last_op or "-",
                _format_cost(d.cost, self.cost_kind),
                format_bytes(d.param_bytes),
                format_bytes(d.activation_bytes),
                format_bytes(d.budget) if d.budget is not None else "-",
                format_bytes(d.bytes_in),
                format_bytes(d.bytes_out),
                *(
                    (_format_cost(d.transfer_time, "time"), _format_cost(d.cut_cost, "time"))
                    if self.links is not None or self.overhead
                    else ()
                ),
            )
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
        console.print(self.to_table())
        text = console.export_text()
        console.file.close()
        return text.rstrip("\n")


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
    out, into = info.transfers(part, num)
    into_time = [0] * num
    if links is not None:
        for b, size in enumerate(info.step_bytes):
            consumers = info.blob_consumers[b]
            if not consumers or not size:
                continue
            producer = info.blob_producer[b]
            home = part[producer] if producer >= 0 else part[consumers[0]]
            for p in {part[c] for c in consumers}:
                if p != home:
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
            )
        )
    cut_bytes = []
    for c in range(1, n):
        if part[c] != part[c - 1]:
            cut_bytes.append(_cut_bytes(info, c))
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


def _cut_bytes(info: GraphInfo, c: int) -> int:
    """Bytes of the distinct blobs made (or fed) before position ``c`` and read at or after it."""
    total = 0
    for b, consumers in enumerate(info.blob_consumers):
        if not consumers or consumers[-1] < c:
            continue
        producer = info.blob_producer[b]
        first = producer if producer >= 0 else consumers[0]
        if first < c:
            total += info.step_bytes[b]
    return total


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
) -> Plan:
    """Plan and apply an optimal contiguous placement; return the :class:`Plan`.

    One GPU plus host memory (``max_memory={"cuda:0": "2GiB", "cpu": "48GiB"}``, or
    accelerate's ``{0: "2GiB", "cpu": "48GiB"}``) is planned by
    :func:`placement.plan_offload` instead (``offload=None``: whenever the devices are
    one GPU with a budget and then the host): each layer stays resident on the GPU,
    streams its weights from the host or runs on the host, and the plan's
    :attr:`Plan.streamed` names the parameters kept on the host.

    Args:
        model: the model, placed in place.
        devices: a device count (``cuda:0 .. cuda:N-1``) or a list of devices, in
            pipeline order. Optional when ``max_memory`` is given (its keys, in order).
        max_memory: device -> budget for parameters plus peak activations, in bytes or
            as ``"2GB"`` / ``"512MiB"``; devices left out are unlimited.
        sample_inputs: inputs for time profiling (see :func:`placement.profile`).
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
            (typical links by device type, :class:`placement.planning.links.Links`),
            a preset (``"pcie"``, ``"nvlink"``, ``"host"``, ``"memcpy"``), a
            :class:`~placement.planning.links.Link`, a mapping
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
        op_costs: op name -> cost (in ``cost``'s unit: ns for ``"time"``) replacing
            the profiled cost of those ops; other ops keep theirs. Calibration
            (:func:`placement.runtime.calibrate.calibrate`) re-plans this way with
            costs scaled to measured stage times.

    Raises:
        InfeasiblePlacementError: no placement fits the budgets; the message gives the
            smallest uniform budget that would.
        PlanError: bad arguments, or the model already has copies.

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
    check_no_copies(model, "auto_place")
    device_list, budgets = _resolve_devices(devices, max_memory)
    if offload is None:
        offload = is_offload_budget(device_list, budgets)
    if offload:
        return _auto_offload(
            model,
            device_list,
            budgets,
            cost=cost,
            objective=objective,
            links=links,
            sample_inputs=sample_inputs,
            repeats=repeats,
            runtime=runtime,
        )
    if cost != "time" and links is not None and links is not False and links != "auto":
        raise PlanError(f"links are times: they need cost='time', not cost={cost!r}")
    if cost == "time":
        cost = _time_or_flops(model)
    link_model = resolve_links(links) if cost == "time" else None
    prof = profile(
        model, sample_inputs=sample_inputs, time=cost == "time", repeats=repeats, optimized=runtime == "ort"
    )
    costs = prof.costs(cost)
    info = GraphInfo(model)
    if op_costs is not None:
        costs = _override_costs(info, costs, op_costs)
    allowed = constant_glue(info)
    cuts = None
    if fusion and cost == "time" and len(device_list) > 1:
        from placement.planning.fusion import fused_cuts, fusion_cut_costs

        if runtime == "ort":
            allowed = [a and f for a, f in zip(allowed, fused_cuts(model, info))]
        else:
            cuts = fusion_cut_costs(model, info, repeats=repeats)
    links_in = None
    if link_model is not None:
        links_in = [
            link_model.link(device_list[max(k - 1, 0)], device_list[k]) for k in range(len(device_list))
        ]
        if not link_model.uniform_into(device_list):
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
    plan = build_plan(
        info,
        costs,
        ends,
        device_list,
        budgets,
        cost_kind=cost,
        objective=objective,
        fp=prof.fingerprint,
        links=link_model,
        cut_costs=cuts,
    )
    plan.runtime = runtime
    plan.apply(model)
    log.info(
        "auto_place: %d ops on %d devices, bottleneck %.3f x lower bound, %d bytes copied per step",
        len(info),
        len(device_list),
        plan.ratio,
        plan.transfer_bytes,
    )
    return plan


def _auto_offload(
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
) -> Plan:
    """``auto_place`` for one GPU plus the host: :func:`plan_offload`, reported as a :class:`Plan`."""
    from placement.planning.offload import plan_offload

    if not is_offload_budget(devices, budgets):
        raise PlanError("offload=True needs exactly one GPU with a budget, then the host")
    if cost == "time":
        cost = _time_or_flops(model)
    kind = cost if cost in ("time", "flops") else "flops"
    offload = plan_offload(
        model,
        {devices[0]: budgets[0], devices[1]: budgets[1]},
        links=links,
        cost=kind,
        sample_inputs=sample_inputs,
        repeats=repeats,
    )
    prof = profile(model, sample_inputs=sample_inputs, time=kind == "time", repeats=repeats)
    info = GraphInfo(model)
    part = [
        1 if offload.modes[layer.name] == "host" else 0
        for layer in offload.layers
        for _ in range(layer.start, layer.end)
    ]
    link_model = resolve_links(links) if kind == "time" else None
    plan = evaluate_assignment(
        info,
        prof.costs(cost),
        part,
        devices,
        budgets,
        cost_kind=cost,
        objective=objective,
        fp=prof.fingerprint,
        links=link_model,
    )
    streamed = offload.streamed_parameters()
    gpu_row = plan.devices[0]
    params = info.param_names
    streamed_set = set(streamed)
    streamed_bytes = sum(info.param_bytes[k] for k, name in enumerate(params) if name in streamed_set)
    gpu_row.param_bytes = gpu_row.param_bytes - streamed_bytes + 2 * offload.window
    plan.devices[1].param_bytes += streamed_bytes
    plan.streamed = {name: str(offload.host) for name in streamed}
    plan.stream_window = offload.window if streamed else None
    plan.runtime = runtime
    plan.apply(model)
    log.info("auto_place: %s", offload)
    return plan
