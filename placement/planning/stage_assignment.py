"""Stage assignment (Keras IPU's ``get/set_pipeline_stage_assignment``).

``get_stage_assignment(model)`` lists one :class:`StageAssignment` per op in graph
(topological) order; edit ``.stage`` and hand the list back to
``set_stage_assignment``. Stage ``k`` is device ``devices[k]``, by default ``cuda:k``.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> assignments = pl.get_stage_assignment(model)
    >>> stage = 0
    >>> for a in assignments:
    ...     if a.scope == "fc2":
    ...         stage = 1
    ...     a.stage = stage
    >>> pl.set_stage_assignment(model, assignments)
    >>> [a.stage for a in pl.get_stage_assignment(model)]
    [0, 0, 1, 1, 1]
    >>> [row.ops for row in pl.summary(model).rows]
    [2, 3]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from placement.errors import PlanError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model
from placement.graph.nodes import is_copy_node, node_device, node_scope, set_node_device
from placement.planning.frontend import check_no_copies, transaction

__all__ = ["StageAssignment", "get_stage_assignment", "set_stage_assignment"]

log = logging.getLogger(__name__)


@dataclass
class StageAssignment:
    """The pipeline stage of one op (edit ``stage``).

    Attributes:
        op: op name.
        op_type: ONNX op type.
        scope: module path, or None.
        stage: index into the device list (``cuda:stage`` by default).
    """

    op: str
    op_type: str
    scope: str | None
    stage: int


def _stage_devices(devices: Sequence[DeviceLike] | None) -> list[Device] | None:
    if devices is None:
        return None
    parsed = [Device.parse(d) for d in devices]
    if len(set(parsed)) != len(parsed):
        raise PlanError(f"devices repeat: {[str(d) for d in parsed]}")
    return parsed


def get_stage_assignment(
    model: Model, *, devices: Sequence[DeviceLike] | None = None
) -> list[StageAssignment]:
    """One :class:`StageAssignment` per op (copies excluded), in graph order.

    Args:
        model: the model.
        devices: stage ``k`` is ``devices[k]``; default: stage ``k`` is ``cuda:k``.

    Raises:
        PlanError: an op sits on a device that is no stage (name ``devices``).
    """
    mapping = _stage_devices(devices)
    index = {d: k for k, d in enumerate(mapping)} if mapping is not None else None
    result = []
    for node in model.graph:
        if is_copy_node(node):
            continue
        device = node_device(node)
        if index is None:
            if device.type != "cuda":
                raise PlanError(
                    f"op {node.name!r} is on {device}, which is no default stage (cuda:k); pass devices=[...]"
                )
            stage = device.index
        else:
            if device not in index:
                known = [str(d) for d in mapping or []]
                raise PlanError(f"op {node.name!r} is on {device}, which is not among devices {known}")
            stage = index[device]
        result.append(StageAssignment(node.name or "", node.op_type, node_scope(node), stage))
    return result


def set_stage_assignment(
    model: Model,
    assignment: Sequence[StageAssignment] | Mapping[str, int],
    *,
    devices: Sequence[DeviceLike] | None = None,
) -> None:
    """Place each listed op on its stage's device, in place; unlisted ops stay (transactional).

    Args:
        model: the model.
        assignment: :class:`StageAssignment` objects or a mapping op name -> stage.
        devices: stage ``k`` is ``devices[k]``; default ``cuda:k``.

    Raises:
        UnknownOpError: an op is not in the model.
        PlanError: a stage is not a non-negative int, or is past ``devices``.
    """
    check_no_copies(model, "set_stage_assignment")
    mapping = _stage_devices(devices)
    if isinstance(assignment, Mapping):
        items = list(assignment.items())
    else:
        items = []
        for a in assignment:
            if not isinstance(a, StageAssignment):
                raise PlanError(f"expected StageAssignment objects, got {type(a).__name__}")
            items.append((a.op, a.stage))
    plan = []
    for op, stage in items:
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise PlanError(f"op {op!r}: stage must be a non-negative int, got {stage!r}")
        if mapping is not None and stage >= len(mapping):
            raise PlanError(f"op {op!r}: stage {stage} but only {len(mapping)} devices were given")
        node = model.op(op).node  # raises UnknownOpError
        if is_copy_node(node):
            raise PlanError(f"op {op!r} is a copy; copies follow their consumers")
        plan.append((node, mapping[stage] if mapping is not None else Device("cuda", stage)))
    with transaction(model):
        for node, device in plan:
            set_node_device(node, device)
    log.info("set_stage_assignment: %d ops", len(plan))
