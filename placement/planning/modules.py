"""Module maps, modelsplit's ``layer_gpus``: module path -> device, read and applied.

Module paths come from each op's scope (``op.scope``, recorded by the exporter), so
they work on any imported model without the original ``nn.Module``.

* ``module_devices(model)`` lists the modules at ``named_children`` level: the first
  component of each scope. Containers whose children are all numbered (an
  ``nn.ModuleList`` or ``nn.Sequential`` of blocks, which own no ops themselves)
  are expanded one level, so a GPT shows ``blocks.0``, ``blocks.1``, ... rather than
  one ``blocks`` entry holding the whole network; pass ``expand_containers=False``
  for the literal ``named_children``. With ``fine_grained=True`` every distinct
  scope (the leaf module that produced an op, or a parent module that computes
  something itself, like a residual add) is listed.
* ``assign_modules(model, mapping)`` applies a mapping. A key matches an op whose
  scope is the key or lies under it (``"blocks.0"`` matches ``blocks.0.attn`` but not
  ``blocks.01``); when several keys match, the longest wins, so ``{"blocks": 0,
  "blocks.3": 1}`` is meaningful. Matched ops move; ops with no scope follow their
  neighbours (:func:`placement.planning.frontend.follow_neighbours`); scoped ops no key
  matches keep their device.

Example:
    >>> import placement as pl
    >>> from placement.models import gpt
    >>> model = pl.from_torch(*gpt.build("tiny"))
    >>> layer_gpus = pl.module_devices(model)
    >>> list(layer_gpus)
    ['wte', 'wpe', 'blocks.0', 'blocks.1', 'ln_f', 'lm_head']
    >>> for key in ["blocks.1", "ln_f", "lm_head"]:
    ...     layer_gpus[key] = 1
    >>> pl.assign_modules(model, layer_gpus)
    >>> [str(d) for d in pl.module_devices(model).values()]
    ['cuda:0', 'cuda:0', 'cuda:0', 'cuda:1', 'cuda:1', 'cuda:1']
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping

import onnx_ir as ir

from placement.errors import DeviceError, PlanError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model
from placement.graph.nodes import is_copy_node, node_device, node_scope, set_node_device
from placement.planning.frontend import check_no_copies, follow_neighbours, transaction

__all__ = ["module_devices", "assign_modules", "module_units", "match_scope"]

log = logging.getLogger(__name__)


def _is_index(text: str) -> bool:
    return text.isdigit()


def _containers(scopes: list[str]) -> set[str]:
    """Top-level paths that own no op directly and whose children are all numbered."""
    direct: set[str] = set()
    children: dict[str, set[str]] = {}
    for scope in scopes:
        parts = scope.split(".")
        if len(parts) == 1:
            direct.add(parts[0])
        else:
            children.setdefault(parts[0], set()).add(parts[1])
    return {top for top, kids in children.items() if top not in direct and all(_is_index(k) for k in kids)}


def module_units(
    model: Model, *, fine_grained: bool = False, expand_containers: bool = True
) -> OrderedDict[str, list[ir.Node]]:
    """Module path -> its ops (graph order), paths in order of first appearance.

    Ops without a scope, and copies, belong to no unit.
    """
    nodes = [n for n in model.graph if not is_copy_node(n)]
    scopes = [node_scope(n) for n in nodes]
    containers = _containers([s for s in scopes if s]) if expand_containers and not fine_grained else set()
    units: OrderedDict[str, list[ir.Node]] = OrderedDict()
    for node, scope in zip(nodes, scopes):
        if not scope:
            continue
        if fine_grained:
            key = scope
        else:
            parts = scope.split(".")
            key = ".".join(parts[:2]) if parts[0] in containers else parts[0]
        units.setdefault(key, []).append(node)
    return units


def match_scope(scope: str | None, keys: Mapping[str, object] | set[str]) -> str | None:
    """The longest key that is ``scope`` or a module path above it, else None."""
    if not scope:
        return None
    parts = scope.split(".")
    for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in keys:
            return candidate
    return None


def module_devices(
    model: Model, *, fine_grained: bool = False, expand_containers: bool = True
) -> OrderedDict[str, Device]:
    """An ordered, editable map module path -> device (the most common device of its ops).

    Args:
        model: the model.
        fine_grained: list every distinct op scope instead of top-level modules.
        expand_containers: list ``blocks.0, blocks.1, ...`` for numbered containers.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> {k: str(d) for k, d in pl.module_devices(model).items()}  # doctest: +NORMALIZE_WHITESPACE
        {'fc1': 'cuda:0', 'relu1': 'cuda:0', 'fc2': 'cuda:0', 'relu2': 'cuda:0',
         'fc3': 'cuda:0'}
    """
    result: OrderedDict[str, Device] = OrderedDict()
    for key, nodes in module_units(
        model, fine_grained=fine_grained, expand_containers=expand_containers
    ).items():
        counts = Counter(node_device(n) for n in nodes)
        result[key] = counts.most_common(1)[0][0]
    return result


def known_modules_message(model: Model) -> str:
    """A short list of the model's top-level modules, for error messages."""
    keys = list(module_units(model))
    shown = ", ".join(keys[:12]) + (", ..." if len(keys) > 12 else "")
    return f"known top-level modules: {shown}" if keys else "the model's ops carry no module scopes"


def assign_modules(model: Model, mapping: Mapping[str, DeviceLike]) -> None:
    """Place every op under each module path of ``mapping`` on its device, in place.

    Keys match by module-path prefix, the longest key winning; unscoped ops follow
    their neighbours; other ops keep their device. Transactional.

    Raises:
        PlanError: a key matches no op (the message lists the known modules), or the
            model already has copies.
        DeviceError: a value is not a device (the message names its key).

    Example:
        >>> import placement as pl
        >>> from placement.models import resnet
        >>> model = pl.from_torch(*resnet.build("tiny"))
        >>> pl.assign_modules(model, {"layer2": 1, "fc": "cuda:1", "avgpool": 1})
        >>> sorted({str(op.device) for op in model.ops if op.scope and op.scope.startswith("layer2")})
        ['cuda:1']
    """
    if not isinstance(mapping, Mapping):
        raise PlanError(f"assign_modules needs a mapping module path -> device, got {type(mapping).__name__}")
    check_no_copies(model, "assign_modules")
    devices: dict[str, Device] = {}
    for key, spec in mapping.items():
        if not isinstance(key, str) or not key:
            raise PlanError(f"module paths are non-empty strings, got {key!r}")
        try:
            devices[key] = Device.parse(spec)
        except DeviceError as err:
            raise DeviceError(f"module {key!r}: {err}") from err
    nodes = [n for n in model.graph if not is_copy_node(n)]
    matched: set[str] = set()
    plan: list[tuple[ir.Node, Device]] = []
    free: list[ir.Node] = []
    for node in nodes:
        scope = node_scope(node)
        if not scope:
            free.append(node)
            continue
        key = match_scope(scope, devices)
        if key is not None:
            matched.add(key)
            plan.append((node, devices[key]))
    unmatched = [k for k in devices if k not in matched]
    if unmatched:
        raise PlanError(f"module {unmatched[0]!r} matches no op; {known_modules_message(model)}")
    with transaction(model):
        for node, device in plan:
            set_node_device(node, device)
        follow_neighbours(model, free)
    log.info("assign_modules: %d modules, %d ops placed", len(devices), len(plan))
