"""Blocks, poptorch's ``BeginBlock``: a module and everything after it go to a device.

``begin_block(model, "layer4", device=1)`` moves the first op of ``layer4`` (in graph,
that is topological, order) and every op after it to ``cuda:1``. Calls compose like
poptorch's annotations, in any order: each call records its block start in the model
(``metadata_props["placement.blocks"]``, so it survives save/load), and a block runs
up to the next recorded block start. A recorded start that another front-end has
since overwritten (its first op no longer sits on the block's device) is forgotten.

Example:
    >>> import placement as pl
    >>> from placement.models import resnet
    >>> model = pl.from_torch(*resnet.build("tiny"))
    >>> pl.begin_block(model, "layer2", device=2)
    >>> pl.begin_block(model, "layer1", device=1)   # order of calls does not matter
    >>> for module, device in pl.module_devices(model, expand_containers=False).items():
    ...     print(module, device)
    conv1 cuda:0
    bn1 cuda:0
    relu cuda:0
    layer1 cuda:1
    layer2 cuda:2
    avgpool cuda:2
    fc cuda:2
"""

from __future__ import annotations

import json
import logging

from placement.errors import PlanError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model
from placement.graph.nodes import is_copy_node, node_device, node_scope, set_node_device
from placement.planning.frontend import check_no_copies, transaction
from placement.planning.modules import known_modules_message, match_scope

__all__ = ["begin_block", "blocks", "clear_blocks", "BLOCKS_KEY"]

log = logging.getLogger(__name__)

#: Model metadata key holding the recorded block starts (JSON list of [module, device]).
BLOCKS_KEY = "placement.blocks"


def blocks(model: Model) -> list[tuple[str, Device]]:
    """The recorded block starts ``(module, device)`` in graph order, stale ones dropped."""
    raw = model.ir_model.metadata_props.get(BLOCKS_KEY)
    if not raw:
        return []
    try:
        entries = [(str(m), Device.parse(d)) for m, d in json.loads(raw)]
    except (ValueError, TypeError):
        log.warning("ignoring malformed %s metadata", BLOCKS_KEY)
        return []
    starts = _first_positions(model, {m for m, _ in entries})
    nodes = [n for n in model.graph if not is_copy_node(n)]
    live = []
    for module, device in entries:
        pos = starts.get(module)
        if pos is not None and node_device(nodes[pos]) == device:
            live.append((pos, module, device))
    return [(m, d) for _, m, d in sorted(live)]


def clear_blocks(model: Model) -> None:
    """Forget the recorded block starts (devices are left as they are)."""
    model.ir_model.metadata_props.pop(BLOCKS_KEY, None)


def _first_positions(model: Model, modules: set[str]) -> dict[str, int]:
    first: dict[str, int] = {}
    nodes = [n for n in model.graph if not is_copy_node(n)]
    for pos, node in enumerate(nodes):
        scope = node_scope(node)
        if not scope:
            continue
        parts = scope.split(".")
        for k in range(1, len(parts) + 1):
            path = ".".join(parts[:k])
            if path in modules and path not in first:
                first[path] = pos
    return first


def begin_block(model: Model, module: str, device: DeviceLike) -> None:
    """Move ``module``'s first op and every later op (up to the next block) to ``device``.

    Args:
        model: the model, changed in place.
        module: a module path (``"layer4"``, ``"blocks.3"``); prefix match on scopes.
        device: the block's device.

    Raises:
        PlanError: no op lies in ``module`` (the message lists the known modules), or
            the model already has copies.
        DeviceError: ``device`` is malformed.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> pl.begin_block(model, "fc2", device=1)
        >>> [str(op.device) for op in model.ops]
        ['cuda:0', 'cuda:0', 'cuda:1', 'cuda:1', 'cuda:1']
    """
    target = Device.parse(device)
    if not isinstance(module, str) or not module:
        raise PlanError(f"begin_block needs a module path, got {module!r}")
    check_no_copies(model, "begin_block")
    nodes = [n for n in model.graph if not is_copy_node(n)]
    start = None
    for pos, node in enumerate(nodes):
        if match_scope(node_scope(node), {module}) is not None:
            start = pos
            break
    if start is None:
        raise PlanError(f"module {module!r} matches no op; {known_modules_message(model)}")
    existing = [(m, d) for m, d in blocks(model) if m != module]
    positions = _first_positions(model, {m for m, _ in existing})
    end = min((positions[m] for m, _ in existing if positions[m] > start), default=len(nodes))
    with transaction(model):
        for node in nodes[start:end]:
            set_node_device(node, target)
        entries = [[m, str(d)] for m, d in existing] + [[module, str(target)]]
        entries.sort(key=lambda e: positions.get(e[0], start))
        model.ir_model.metadata_props[BLOCKS_KEY] = json.dumps(entries)
    log.info("begin_block %s on %s: ops %d..%d", module, target, start, end - 1)
