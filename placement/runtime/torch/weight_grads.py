"""A stage's backward in two parts: input gradients now, weight gradients later.

The backward of a stage computes two kinds of gradients: those of its *inputs*
(the previous stage waits for them) and those of its *parameters* (nobody
waits for them until the optimizer step). A matrix product ``x @ W`` pays
about as much for ``dW`` as for ``dx``. Computing the input gradients first
and the weight gradients later lets a pipeline hand the previous stage its
gradient sooner and fill the time a stage would otherwise wait with weight
gradients: the *zero-bubble* schedules (Qi et al., 2023), and the deferred
weight-gradient computation of Megatron-LM.

:func:`backward_inputs` does this on an ordinary autograd graph:

1. It walks the graph from the outputs and finds, for every parameter, the
   *merge nodes*: the first nodes above the parameter (towards the outputs)
   that also lie on a path from the outputs to an input. For ``y = x @ W`` that
   is the matrix product's backward node.
2. It runs ``torch.autograd.grad`` for the inputs only, with a pre-hook on each
   merge node that keeps the gradient flowing into it. Autograd skips every
   branch that leads only to parameters, so no weight gradient is computed.
3. :class:`DeferredWeights` later runs, group by group, ``torch.autograd.grad``
   from the kept gradients at the merge nodes (``GradientEdge`` s) to the
   parameters: only the parameter side of each merge node runs.

Parameters that share a merge node form one group. A group with several merge
nodes (a weight read twice in the stage) pins each node's incoming gradient to
the kept one (a pre-hook), so a path between two of its merge nodes is not
counted twice. A parameter with a path to an output that meets no input path
(an output computed from parameters alone), or with no merge node at all (the
stage's inputs need no gradient), gets its gradient in step 2 with the inputs.
The sum of the two parts equals one ``torch.autograd.grad`` for everything.

Example:
    >>> import torch
    >>> x = torch.randn(3, 4, requires_grad=True)
    >>> w = torch.randn(4, 2, requires_grad=True)
    >>> y = torch.tanh(x @ w)
    >>> dx, now, later = backward_inputs([y], [torch.ones_like(y)], [x], [w])
    >>> now, len(later)                     # dW not computed yet
    ([None], 1)
    >>> (dw,) = dict(later.run_all()).values()
    >>> ref_x, ref_w = torch.autograd.grad(torch.tanh(x @ w).sum(), [x, w])
    >>> torch.allclose(dx[0], ref_x), torch.allclose(dw, ref_w)
    (True, True)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["DEFER_MIN_MACS", "DeferredWeights", "backward_inputs", "defer_pays", "activation_rows"]


#: Least multiply-adds (rows x parameter elements) of a stage's weight gradients for one
#: micro-batch at which ``defer_weights="auto"`` computes them apart from the input gradients.
#: Splitting a backward costs a graph walk, hooks and one autograd call per weight group
#: (tens of microseconds of Python); below about a million multiply-adds (a few tens of
#: microseconds of compute on one core) the split costs more than the time it frees.
DEFER_MIN_MACS = 1 << 20


def defer_pays(inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    """Whether deferring the weight gradients of a backward with these ``inputs`` (activations)
    and ``params`` pays: rows (an input's elements over its last axis) x parameter elements
    reach :data:`DEFER_MIN_MACS`.

    Example:
        >>> import torch
        >>> defer_pays([torch.zeros(4, 8)], [torch.zeros(8, 8)])
        False
        >>> defer_pays([torch.zeros(8, 128, 512)], [torch.zeros(512, 512)])
        True
    """
    return activation_rows(inputs) * sum(p.numel() for p in params) >= DEFER_MIN_MACS


def activation_rows(inputs: Sequence[torch.Tensor]) -> int:
    """The most rows (elements over the last axis) of the activations ``inputs``."""
    return max((t.numel() // max(1, t.shape[-1]) for t in inputs if t.dim() > 0), default=1)


@dataclass
class _Group:
    """Parameters (by index) whose weight gradients flow through the same merge nodes."""

    params: list[int]
    merges: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


class DeferredWeights:
    """The weight gradients :func:`backward_inputs` left for later, one group at a time.

    ``len(deferred)`` is the number of groups not claimed yet; :meth:`run_next` runs one
    and returns ``(parameter index, gradient)`` pairs (indices into the ``params``
    given to :func:`backward_inputs`); :meth:`run_all` runs the rest; :meth:`take` and
    :meth:`run` split claiming a group from running it. The autograd graph stays alive
    as long as this object.
    """

    def __init__(self, groups: list[_Group], nodes: list[Node]) -> None:
        self._groups = groups
        self._nodes = nodes  # the parameters' gradient accumulators, by index

    def __len__(self) -> int:
        return len(self._groups)

    def take(self) -> _Group:
        """Claim the next group (to :meth:`run`, possibly on another thread)."""
        return self._groups.pop(0)

    def run(self, group: _Group) -> list[tuple[int, torch.Tensor]]:
        """Run a claimed group's weight gradients: ``(parameter index, gradient)`` pairs.

        Groups of one graph touch disjoint nodes, so two threads may run two of them at once.
        """
        edges, seeds = [], []
        for node in group.merges:
            for slot, grad in enumerate(group.grads.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, slot))
                    seeds.append(grad)
        if not edges:
            return []
        handles = []
        try:
            if len(group.merges) > 1:  # a path from one merge node to another: use the kept gradient
                for node in group.merges:
                    kept = group.grads.get(node)
                    if kept is not None:
                        handles.append(node.register_prehook(lambda _grads, kept=kept: kept))
            grads = torch.autograd.grad(
                edges,
                [GradientEdge(self._nodes[p], 0) for p in group.params],
                seeds,
                retain_graph=True,
                allow_unused=True,
            )
        finally:
            for handle in handles:
                handle.remove()
        return [(p, g) for p, g in zip(group.params, grads) if g is not None]

    def run_next(self) -> list[tuple[int, torch.Tensor]]:
        """Run the next group's weight gradients."""
        return self.run(self.take())

    def run_all(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Run every remaining group (a generator of ``(parameter index, gradient)`` pairs)."""
        while self._groups:
            yield from self.run_next()


def backward_inputs(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], DeferredWeights]:
    """Back-propagate ``grad_outputs`` to ``inputs`` now and to ``params`` mostly later.

    Args:
        outputs: tensors of the graph (requiring grad).
        grad_outputs: their gradients.
        inputs: tensors requiring grad whose gradients are wanted now.
        params: leaf tensors requiring grad (parameters).

    Returns:
        ``(input grads, param grads computed now, deferred)``: the inputs' gradients
        (None where unused), the gradients of the parameters that could not be deferred
        (None for the deferred and unused ones), and the :class:`DeferredWeights` that
        compute the rest.
    """
    with torch.enable_grad():
        roots = [n for n in (_node(t) for t in outputs) if n is not None]
        input_nodes = [_node(t) for t in inputs]
        param_nodes = [_node(t) for t in params]
    parents = _parents(roots)
    on_input_path = _above([n for n in input_nodes if n is not None], parents)
    roots_set = set(roots)
    merges_of: dict[int, list[Node]] = {}
    for p, node in enumerate(param_nodes):
        if node is None or node not in parents and node not in roots_set:
            continue
        merges, direct = _merges(node, parents, on_input_path, roots_set)
        if merges and not direct:
            merges_of[p] = merges
    groups = _groups(merges_of)
    now = [p for p in range(len(params)) if p not in merges_of]
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = []

    def keep(node: Node) -> object:
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            captured[node] = grads

        return hook

    try:
        for group in groups:
            for node in group.merges:
                handles.append(node.register_prehook(keep(node)))
        wanted = list(inputs) + [params[p] for p in now]
        grads = (
            torch.autograd.grad(
                list(outputs), wanted, list(grad_outputs), retain_graph=bool(groups), allow_unused=True
            )
            if wanted
            else ()
        )
    finally:
        for handle in handles:
            handle.remove()
    for group in groups:
        group.grads = {node: captured[node] for node in group.merges if node in captured}
    param_grads: list[torch.Tensor | None] = [None] * len(params)
    for p, g in zip(now, grads[len(inputs) :]):
        param_grads[p] = g
    return list(grads[: len(inputs)]), param_grads, DeferredWeights(groups, param_nodes)  # type: ignore[arg-type]


def _node(tensor: torch.Tensor) -> Node | None:
    """The autograd node a gradient for ``tensor`` flows into: its ``grad_fn``, or a leaf's accumulator."""
    if not tensor.requires_grad:
        return None
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]  # the leaf's AccumulateGrad


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node below ``roots``: the nodes with an edge to it (towards the outputs)."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    stack = list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return parents


def _above(starts: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``starts`` and every node on a path from an output down to one of them."""
    found = set(starts)
    stack = list(starts)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


def _merges(
    start: Node, parents: dict[Node, list[Node]], on_input_path: set[Node], roots: set[Node]
) -> tuple[list[Node], bool]:
    """The first nodes above ``start`` on an input path, and whether some path reaches an
    output without meeting one."""
    merges: list[Node] = []
    seen = {start}
    stack = [start]
    direct = False
    while stack:
        node = stack.pop()
        if node in roots and node not in on_input_path:
            direct = True
        for parent in parents.get(node, ()):
            if parent in seen:
                continue
            seen.add(parent)
            if parent in on_input_path:
                merges.append(parent)
            else:
                stack.append(parent)
    return merges, direct


def _groups(merges_of: dict[int, list[Node]]) -> list[_Group]:
    """Parameters sharing a merge node, grouped (union-find), in parameter order."""
    owner: dict[Node, int] = {}
    root = {p: p for p in merges_of}

    def find(p: int) -> int:
        while root[p] != p:
            root[p] = root[root[p]]
            p = root[p]
        return p

    for p, merges in merges_of.items():
        for node in merges:
            if node in owner:
                root[find(p)] = find(owner[node])
            else:
                owner[node] = p
    members: dict[int, list[int]] = defaultdict(list)
    for p in merges_of:
        members[find(p)].append(p)
    groups = []
    for ps in members.values():
        nodes: list[Node] = []
        for p in ps:
            nodes += [n for n in merges_of[p] if n not in nodes]
        groups.append(_Group(ps, nodes))
    return groups
