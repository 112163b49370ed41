"""Shared helpers of the placement front-ends: neighbour propagation and transactions.

:func:`follow_neighbours` places "free" ops (ops with no module scope, or that a
front-end did not address) next to the ops around them, by label propagation in
graph order: a free op takes the device of the *latest* producer among its inputs
(the op whose output it consumes that runs last, so it joins the stage its data
comes from and contiguous partitions stay contiguous); a free op fed only by
parameters and graph inputs takes the device of its first consumer instead (a
backward sweep); an op with neither keeps its device.

Example:
    >>> import placement as pl
    >>> from placement.planning.frontend import follow_neighbours
    >>> from placement.models import resnet
    >>> model = pl.from_torch(*resnet.build("tiny"))
    >>> for op in model.ops:
    ...     if op.scope == "fc":
    ...         model.set_device(op.name, 1)
    >>> free = [op.node for op in model.ops if op.scope is None]
    >>> follow_neighbours(model, free)
    >>> [str(op.device) for op in model.ops if op.scope is None]  # the Reshape before fc
    ['cuda:0']
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import onnx_ir as ir

from placement.analysis.dependence import copy_origin
from placement.errors import PlanError
from placement.graph.model import Model
from placement.graph.nodes import is_copy_node, node_device, set_node_device

__all__ = ["follow_neighbours", "transaction", "check_no_copies"]


def follow_neighbours(model: Model, free: Iterable[ir.Node]) -> None:
    """Give each op in ``free`` the device of its neighbours (see the module docstring)."""
    free_ids = {id(n) for n in free}
    if not free_ids:
        return
    nodes = [n for n in model.graph if not is_copy_node(n)]
    position = {id(n): i for i, n in enumerate(nodes)}
    deferred: list[ir.Node] = []
    for node in nodes:
        if id(node) not in free_ids:
            continue
        latest = None
        for value in node.inputs:
            producer = copy_origin(value).producer() if value is not None else None
            if producer is None or producer.graph is not model.graph:
                continue
            if latest is None or position.get(id(producer), -1) > position.get(id(latest), -1):
                latest = producer
        if latest is not None:
            set_node_device(node, node_device(latest))
        else:
            deferred.append(node)
    for node in reversed(deferred):
        first = None
        for value in node.outputs:
            for use in value.uses():
                consumer = use.node
                if consumer.graph is not model.graph or is_copy_node(consumer):
                    continue
                if first is None or position.get(id(consumer), 0) < position.get(id(first), 0):
                    first = consumer
        if first is not None:
            set_node_device(node, node_device(first))


@contextlib.contextmanager
def transaction(model: Model) -> Iterator[None]:
    """Restore every op's device if the body raises (front-ends are all-or-nothing)."""
    state = model.device_state()
    try:
        yield
    except BaseException:
        model.restore_device_state(state)
        raise


def check_no_copies(model: Model, what: str) -> None:
    """Front-ends place ops before copies exist; refuse a model that already has copies.

    Raises:
        PlanError: the model has cross-device copies.
    """
    for node in model.graph:
        if is_copy_node(node):
            raise PlanError(
                f"{what}: the model already has cross-device copies (e.g. {node.name!r}); "
                "place ops first, then call inject_cross_device_copies"
            )
