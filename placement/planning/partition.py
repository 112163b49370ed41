"""The partition problem: exact bottleneck-optimal contiguous partitions of an op order.

:class:`PartitionProblem` holds per-op costs, per-part memory budgets and (optionally) the
links copies travel on and the cost of cuts; its methods decide feasibility by a greedy
sweep, find the optimal bottleneck by bisection or an exact min-max dynamic programme, and
pick, among partitions at that bottleneck, one that copies the least (see
:mod:`placement.planning.planner` for the objectives). :func:`partition_costs` is the
cost-only form; :func:`constant_glue` marks the cuts that would split a load-time value from
its reader.

Example:
    >>> partition_costs([1, 2, 3, 4, 5, 6], 3)
    [3, 2, 1]
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Sequence
from typing import Any

from placement.errors import InfeasiblePlacementError, PlanError
from placement.graph.sizes import format_bytes
from placement.planning.link_model import Link
from placement.planning.profile import GraphInfo

__all__ = ["PartitionProblem", "partition_costs", "constant_glue"]

log = logging.getLogger(__name__)


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
                    if b not in seen and info.blob_first[b] < i:
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
