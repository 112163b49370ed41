"""Fold logical devices that share a physical device into one: one session where one device runs.

A placed model's stages are same-*logical*-device segments. When a device map sends several
logical devices to one physical device (``{0: "cuda:0", 1: "cuda:0"}``, ``"auto"`` on fewer GPUs
than logical devices, ``device_map="cpu"``), running them as separate ONNX Runtime sessions
costs sessions (several CUDA sessions in one process slow each other, and each holds its
own memory), a fixed cost per stage call, and fusions lost at the cuts, for nothing: one
device runs one stage at a time anyway. :func:`fold_groups` says which logical devices fold
into which, and :func:`fold_model` relabels a private copy of the model accordingly, so
that cutting it into stages gives one stage (one session) per run of folded devices: the
copies between folded devices are removed (their readers read the copied blob itself; a
copy that is a graph output becomes a plain ``Identity``). The placement the user sees
(op devices, copies, the saved file) is not touched; only the runtime's private copy is.

Which devices fold (``fold`` as :class:`placement.Runner` takes it):

* ``fold=None`` (the default): logical devices on one GPU fold always. Logical devices on
  the CPU fold for sequential runs, but not for pipelined ones (``chunks > 1``,
  ``Runner.stream``): the CPU's cores really run several stages at once, so stages kept
  apart there overlap (the pipelining speed-up). Logical GPUs that ``"auto"`` emulates on a
  machine without GPUs never fold: the emulation exists to exercise stage boundaries.
* ``fold=True``: every group of logical devices on one physical device folds, emulated or
  pipelined too.
* ``fold=False``: nothing folds (one session per logical-device stage, for measurements
  and tests of stage boundaries).

Example:
    >>> from placement import Device
    >>> from placement.runtime.device_map import PhysicalDevice
    >>> gpu = PhysicalDevice("cuda", 0)
    >>> dmap = {Device("cuda", 0): gpu, Device("cuda", 1): gpu}
    >>> {str(k): str(v) for k, v in fold_groups(dmap).items()}
    {'cuda:1': 'cuda:0'}
    >>> fold_groups(dmap, fold=False)
    {}
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from placement.graph.device import Device
from placement.graph.kv_names import is_cache_input
from placement.graph.model import Model
from placement.graph.nodes import (
    COPY_KEY,
    INPUT_DEVICE_KEY,
    OUTPUT_DEVICE_KEY,
    is_copy_node,
    node_device,
    set_node_device,
)
from placement.runtime.device_map import PhysicalDevice

__all__ = ["fold_groups", "fold_model", "folded_devices"]

log = logging.getLogger(__name__)


def fold_groups(
    device_map: dict[Device, PhysicalDevice],
    *,
    fold: bool | None = None,
    pipelined: bool = False,
    emulating: bool = False,
) -> dict[Device, Device]:
    """Which logical devices fold into which: logical device -> the device it runs as.

    Logical devices that share a physical device form a group; every member but the first
    (in device order) maps to the first. Only groups that fold are listed (see the module
    docstring for ``fold``); a device that is not listed keeps its own stages.

    Args:
        device_map: the resolved logical -> physical map.
        fold: ``None`` (the default rule), ``True`` (fold every shared device) or ``False``.
        pipelined: the program is for a pipelined run (``chunks > 1`` or a stream).
        emulating: the map is ``"auto"``'s (logical GPUs emulated on a machine without GPUs).

    Example:
        >>> from placement import Device
        >>> from placement.runtime.device_map import PhysicalDevice
        >>> cpu = PhysicalDevice("cpu", 0, emulated=True)
        >>> dmap = {Device("cuda", 0): cpu, Device("cuda", 1): cpu}
        >>> len(fold_groups(dmap)), len(fold_groups(dmap, pipelined=True))
        (1, 0)
        >>> len(fold_groups(dmap, emulating=True)), len(fold_groups(dmap, fold=True, emulating=True))
        (0, 1)
    """
    if fold is False:
        return {}
    groups: dict[tuple[str, int], list[Device]] = {}
    for logical in sorted(device_map):
        physical = device_map[logical]
        groups.setdefault((physical.type, physical.index), []).append(logical)
    folds: dict[Device, Device] = {}
    for (kind, _), members in groups.items():
        if len(members) < 2:
            continue
        if fold is None and kind != "cuda" and (pipelined or emulating):
            continue
        folds.update((member, members[0]) for member in members[1:])
    return folds


def folded_devices(folds: dict[Device, Device]) -> dict[Device, tuple[Device, ...]]:
    """Each device that others fold into -> every logical device it runs (itself first).

    Example:
        >>> from placement import Device
        >>> a, b, c = Device("cuda", 0), Device("cuda", 1), Device("cuda", 2)
        >>> {str(k): [str(d) for d in v] for k, v in folded_devices({b: a, c: a}).items()}
        {'cuda:0': ['cuda:0', 'cuda:1', 'cuda:2']}
    """
    runs: dict[Device, list[Device]] = {}
    for member, target in sorted(folds.items()):
        runs.setdefault(target, [target]).append(member)
    return {target: tuple(members) for target, members in runs.items()}


def fold_model(model: Model, folds: dict[Device, Device]) -> int:
    """Relabel ``model`` (a private copy: it is changed in place) so folded devices are one.

    Every op on a folded device moves to the device it folds into, and so do the graph
    input and output devices; then every copy whose two ends now share a device is removed
    (its readers read its source), except a copy that is a graph output, which becomes a
    plain ``Identity`` on its device. Streamed copies (of weights that live in host memory)
    stay: they are made every run whatever the device map.

    Returns:
        The number of copies removed or turned into ``Identity``.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> model.set_device(model.ops[-1].name, 1)
        >>> _ = pl.inject_cross_device_copies(model)
        >>> fold_model(model, {pl.Device("cuda", 1): pl.Device("cuda", 0)}), [str(d) for d in model.devices]
        (1, ['cuda:0'])
    """
    if not folds:
        return 0
    graph = model.graph
    for node in graph:
        target = folds.get(node_device(node))
        if target is not None:
            set_node_device(node, target)
    props = model.ir_model.metadata_props
    for key in (INPUT_DEVICE_KEY, OUTPUT_DEVICE_KEY):
        spec = props.get(key)
        if spec and Device.parse(spec) in folds:
            props[key] = str(folds[Device.parse(spec)])
    outputs = set(graph.outputs)
    targets = set(folds.values())
    removed = 0
    for node in list(graph):
        if not is_copy_node(node) or node.metadata_props.get(COPY_KEY) == "streamed":
            continue
        if node_device(node) not in targets:
            continue
        source, out = node.inputs[0], node.outputs[0]
        if source is None or not _same_device(model, node, source):
            continue
        if out in outputs:
            del node.metadata_props[COPY_KEY]  # a plain Identity, inside its stage
        else:
            out.replace_all_uses_with(source)
            graph.remove(node, safe=True)
        removed += 1
    log.debug("folded %d logical devices, %d copies removed", len(folds), removed)
    return removed


def _same_device(model: Model, copy: ir.Node, source: ir.Value) -> bool:
    """Whether a copy's source already lives on the copy's device (after relabelling); a
    graph input read by nothing else is fed where its copy is.

    A parameter's copy (static) on a folded device always qualifies: the readers then carry the parameter
    itself, so a folded session holds one weight, not the weight and its copy."""
    if source.producer() is None and source.name in model.graph.initializers:
        return True
    device = node_device(copy)
    if source.producer() is not None:
        return node_device(source.producer()) == device
    fixed = model.input_device
    if fixed is not None and not is_cache_input(source.name):
        return fixed == device
    readers = [use.node for use in source.uses() if use.node is not copy]
    return not readers or node_device(readers[0]) == device
