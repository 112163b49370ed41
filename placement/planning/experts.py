"""Experts of mixture-of-experts layers: listed, and spread over devices.

An experts module imported through a grouped matmul (Hugging Face's default MoE
implementation, see :mod:`placement.graph.export_rules`) has one ``Slice``/``Gather``/
``MatMul`` group per expert, each op tagged with its expert's index and scoped
``<experts module>.<index>``. :func:`expert_modules` lists them; :func:`spread_experts`
places the experts of every such module round-robin over devices (expert ``g`` on
``devices[g % len(devices)]``), leaving every other op where it is (the router, the
sort of the routed rows and the final sum stay with the experts module).

Example:
    >>> import torch
    >>> import transformers  # doctest: +SKIP
    >>> import placement as pl
    >>> net = transformers.MixtralForCausalLM(transformers.MixtralConfig(  # doctest: +SKIP
    ...     num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
    ...     num_key_value_heads=1, vocab_size=50, num_local_experts=4, use_cache=False))
    >>> model = pl.from_torch(net, (torch.randint(0, 50, (1, 8)),))  # doctest: +SKIP
    >>> spread = pl.spread_experts(model, [0, 1])  # doctest: +SKIP
    >>> [str(d) for d in spread.values()]  # doctest: +SKIP
    ['cuda:0', 'cuda:1', 'cuda:0', 'cuda:1']
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from placement.errors import DeviceError, PlanError
from placement.graph.device import Device, DeviceLike
from placement.graph.export_rules import EXPERT_KEY
from placement.graph.model import Model
from placement.graph.nodes import is_copy_node, node_scope, set_node_device
from placement.planning.frontend import check_no_copies, transaction

__all__ = ["expert_modules", "spread_experts"]

log = logging.getLogger(__name__)


def expert_modules(model: Model) -> OrderedDict[str, list[str]]:
    """Experts module path -> its experts' paths (``<module>.<index>``, by index), in graph order.

    Empty when the model has no experts exported by a grouped matmul.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> expert_modules(pl.from_torch(*mlp.build("tiny")))
        OrderedDict()
    """
    found: OrderedDict[str, dict[int, str]] = OrderedDict()
    for node in model.graph:
        index = node.metadata_props.get(EXPERT_KEY)
        scope = node_scope(node)
        if index is None or is_copy_node(node) or not scope:
            continue
        module, _, last = scope.rpartition(".")
        if last != index:  # the scope is "<module>.<index>" (a root-level module: just "<index>")
            continue
        found.setdefault(module, {})[int(index)] = scope
    return OrderedDict((module, [paths[g] for g in sorted(paths)]) for module, paths in found.items())


def spread_experts(
    model: Model, devices: Sequence[DeviceLike], *, modules: Sequence[str] | None = None
) -> OrderedDict[str, Device]:
    """Place expert ``g`` of each experts module on ``devices[g % len(devices)]``, in place.

    Only the experts' own ops move; other ops keep their device, so this composes
    with any placement made before it (``pl.auto_place``, module maps). Transactional.

    Args:
        model: the model, before ``inject_cross_device_copies``.
        devices: the devices to spread over (``[0, 1]`` = ``cuda:0``, ``cuda:1``).
        modules: the experts modules to spread (paths from :func:`expert_modules`);
            all of them by default.

    Returns:
        Each expert's path -> its device.

    Raises:
        PlanError: the model has no experts, a module in ``modules`` is not an experts
            module, ``devices`` is empty, or the model already has copies.
        DeviceError: a device cannot be parsed.
    """
    check_no_copies(model, "spread_experts")
    if isinstance(devices, (str, int)) or not len(devices):
        raise PlanError(f"spread_experts needs a non-empty list of devices, got {devices!r}")
    targets: list[Device] = []
    for spec in devices:
        try:
            targets.append(Device.parse(spec))
        except DeviceError as err:
            raise DeviceError(f"spread_experts: {err}") from err
    found = expert_modules(model)
    if not found:
        raise PlanError(
            "spread_experts: the model has no experts exported by a grouped matmul "
            "(mixture-of-experts layers imported through pl.from_torch)"
        )
    chosen = list(found) if modules is None else list(modules)
    unknown = [m for m in chosen if m not in found]
    if unknown:
        raise PlanError(f"spread_experts: {unknown[0]!r} is not an experts module; known: {', '.join(found)}")
    mapping: OrderedDict[str, Device] = OrderedDict()
    for module in chosen:
        for g, path in enumerate(found[module]):
            mapping[path] = targets[g % len(targets)]
    with transaction(model):
        for node in model.graph:
            scope = node_scope(node)
            if scope in mapping and EXPERT_KEY in node.metadata_props and not is_copy_node(node):
                set_node_device(node, mapping[scope])
    log.info(
        "spread_experts: %d experts of %d modules over %d devices", len(mapping), len(chosen), len(targets)
    )
    return mapping
