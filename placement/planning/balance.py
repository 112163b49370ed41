"""Balance lists, torchgpipe style: consecutive runs of ops (or modules) per device.

``balance(model, [n0, n1, ...])`` puts the first ``n0`` ops (graph order, copies
excluded) on device 0, the next ``n1`` on device 1, and so on. With ``by="module"``
the runs count top-level modules (the units of :func:`placement.module_devices`:
``blocks.0``, ``blocks.1``, ... for numbered containers) and unscoped ops follow their
neighbours.

``balance_by_time`` and ``balance_by_size`` compute such lists like torchgpipe's
``torchgpipe_balancing`` functions, from per-op profiles, with an exact
min-bottleneck partition (:func:`placement.planning.partition.partition_costs`) instead of
torchgpipe's block-partition heuristic. They return the list; pass it to
:func:`balance` (or use :func:`placement.auto_place`, which also honours memory).

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> pl.balance(model, [2, 3])
    >>> [str(op.device) for op in model.ops]
    ['cuda:0', 'cuda:0', 'cuda:1', 'cuda:1', 'cuda:1']
    >>> pl.balance_by_size(model, 2)
    [2, 3]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import onnx_ir as ir

from placement.errors import PlanError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model
from placement.graph.nodes import is_copy_node, node_scope, set_node_device
from placement.planning.dims import called_as
from placement.planning.frontend import check_no_copies, follow_neighbours, transaction
from placement.planning.modules import module_units
from placement.planning.partition import partition_costs
from placement.planning.profile import profile

__all__ = ["balance", "balance_by_time", "balance_by_size"]

log = logging.getLogger(__name__)

_BY = ("op", "module")


def _units(model: Model, by: str) -> list[list[ir.Node]]:
    if by == "op":
        return [[n] for n in model.graph if not is_copy_node(n)]
    if by == "module":
        return list(module_units(model).values())
    raise PlanError(f"by must be one of {', '.join(_BY)}, got {by!r}")


def balance(
    model: Model,
    balance: Sequence[int],
    *,
    by: str = "op",
    devices: Sequence[DeviceLike] | None = None,
) -> None:
    """Place consecutive runs of ``balance[k]`` ops (or modules) on device ``k``, in place.

    Args:
        model: the model.
        balance: run lengths; they must add up to the number of ops (or modules).
        by: ``"op"`` or ``"module"`` (top-level modules, see :func:`placement.module_devices`).
        devices: the device of each run (default ``cuda:0, cuda:1, ...``).

    Raises:
        PlanError: the lengths are negative or do not add up (the message says to what),
            ``devices`` has the wrong length, or the model already has copies.

    Example:
        >>> import placement as pl
        >>> from placement.models import gpt
        >>> model = pl.from_torch(*gpt.build("tiny"))
        >>> pl.balance(model, [3, 3], by="module")
        >>> [str(d) for d in pl.module_devices(model).values()]
        ['cuda:0', 'cuda:0', 'cuda:0', 'cuda:1', 'cuda:1', 'cuda:1']
    """
    check_no_copies(model, "balance")
    units = _units(model, by)
    sizes = list(balance)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PlanError(f"balance entries must be non-negative ints, got {size!r}")
    if not sizes:
        raise PlanError("balance is empty")
    if sum(sizes) != len(units):
        what = "ops" if by == "op" else "top-level modules"
        extra = "" if by == "op" else f" ({', '.join(module_units(model))})"
        raise PlanError(
            f"balance {sizes} adds up to {sum(sizes)}, but the model has {len(units)} {what}{extra}"
        )
    if devices is None:
        targets = [Device("cuda", k) for k in range(len(sizes))]
    else:
        targets = [Device.parse(d) for d in devices]
        if len(targets) != len(sizes):
            raise PlanError(f"balance has {len(sizes)} runs but {len(targets)} devices were given")
    with transaction(model):
        start = 0
        for size, device in zip(sizes, targets):
            for unit in units[start : start + size]:
                for node in unit:
                    set_node_device(node, device)
            start += size
        if by == "module":
            follow_neighbours(model, [n for n in model.graph if not is_copy_node(n) and not node_scope(n)])
    log.info("balance %s by %s on %s", sizes, by, [str(d) for d in targets])


def _unit_costs(model: Model, op_costs: list[int], by: str) -> list[int]:
    if by == "op":
        return op_costs
    units = module_units(model)
    if not units:
        raise PlanError("the model's ops carry no module scopes; use by='op'")
    nodes = [n for n in model.graph if not is_copy_node(n)]
    index = {id(n): k for k, unit in enumerate(units.values()) for n in unit}
    totals = [0] * len(units)
    current = None
    pending = 0
    for node, cost in zip(nodes, op_costs):
        k = index.get(id(node))
        if k is None:  # unscoped: charged to the previous module (the next, at the start)
            if current is None:
                pending += cost
            else:
                totals[current] += cost
            continue
        current = k
        totals[k] += cost + pending
        pending = 0
    return totals


def balance_by_time(
    model: Model,
    partitions: int,
    sample_inputs: Any = None,
    *,
    by: str = "op",
    repeats: int = 5,
) -> list[int]:
    """A balance list minimising the slowest partition's measured forward time (exact).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> b = pl.balance_by_time(model, 2, repeats=2)
        >>> sum(b), len(b)
        (5, 2)
    """
    with called_as("balance_by_time"):
        costs = profile(model, sample_inputs=sample_inputs, time=True, repeats=repeats).costs("time")
    return partition_costs(_unit_costs(model, costs, by), partitions)


def balance_by_size(model: Model, partitions: int, *, by: str = "op", param_scale: float = 1.0) -> list[int]:
    """A balance list minimising the largest partition's bytes (outputs + scaled parameters).

    ``param_scale`` weighs parameter bytes as torchgpipe does (use ~2-4 for training
    with optimiser state; 1 for inference).
    """
    prof = profile(model, time=False)
    costs = [p.output_bytes + round(param_scale * p.param_bytes) for p in prof.ops.values()]
    return partition_costs(_unit_costs(model, costs, by), partitions)
