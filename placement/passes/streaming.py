"""Streamed parameters: weights that live in host memory and are copied to their reader every run.

A parameter read by an op on a GPU normally lives on that GPU (a parameter lives
where its first reader runs). :func:`stream_parameters` keeps chosen parameters in
host memory instead: :func:`~placement.passes.copies.inject_cross_device_copies`
then reads each of them through a copy marked ``streamed``, which runtimes make on
every run, from pinned host memory on a side copy stream, prefetched ahead of the
op that reads it, into a bounded window of device memory (``window`` bytes, which
the GPU budget counts). The alternative for a weight that does not fit is to run
its ops on the host (place them on ``"cpu"``); the planner
(:func:`placement.plan_offload`) chooses between the two per layer.

The choice is recorded in the model (``placement.streamed``, parameter -> host, and
``placement.stream_window``), so it survives ``save``/``load`` and every later pass.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> result = pl.stream_parameters(model, ["fc1.weight"])
    >>> _ = pl.inject_cross_device_copies(model)
    >>> [(op.inputs[0], op.node.metadata_props["placement.copy"]) for op in model.ops if op.is_copy]
    [('fc1.weight', 'streamed')]
    >>> str(model.parameters["fc1.weight"].device), result.bytes
    ('cpu', 2048)
    >>> pl.verify(model)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable

import onnx_ir as ir

from placement.errors import DeviceError, PlanError, UnknownBlobError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model, value_nbytes
from placement.graph.nodes import COPY_KEY, STREAM_WINDOW_KEY, STREAMED_KEY, node_scope, streamed_homes
from placement.graph.sizes import parse_bytes

__all__ = [
    "stream_parameters",
    "StreamResult",
    "streamable_parameters",
    "is_streamable",
    "WEIGHT_INTEGER_TYPES",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StreamResult:
    """What :func:`stream_parameters` did.

    Attributes:
        added: parameters newly streamed (or moved to another host).
        removed: parameters no longer streamed (``host=None``).
        streamed: every streamed parameter afterwards, name -> host device.
        bytes: bytes of all streamed parameters afterwards.
        window: the prefetch window recorded (bytes), or None (runtimes double-buffer).
        copies_updated: True when the model's copies were re-injected.
    """

    added: list[str] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    streamed: dict[str, Device] = dataclasses.field(default_factory=dict)
    bytes: int = 0
    window: int | None = None
    copies_updated: bool = False


#: Integer types of quantized weights (``quantize_dynamic``'s int8/uint8, int16): streamed like
#: floating-point weights. int32/int64 (shapes, indices, often read as literals while lowering)
#: and bool never are.
WEIGHT_INTEGER_TYPES = frozenset({ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT16, ir.DataType.UINT16})


def is_streamable(value: ir.Value) -> bool:
    """Whether initializer ``value`` is a weight: at least one dimension, floating point or a
    quantized weight's integer type (:data:`WEIGHT_INTEGER_TYPES`)."""
    data = value.const_value
    if data is None or len(data.shape) < 1:
        return False
    return data.dtype.is_floating_point() or data.dtype in WEIGHT_INTEGER_TYPES


def streamable_parameters(model: Model, name: str) -> list[str]:
    """The parameters ``name`` stands for: itself when it is a parameter, else the weights
    (:func:`is_streamable`: floating point or quantized integers, at least one dimension) read
    by the op ``name`` or by the ops of module scope ``name`` (``"blocks.3"``: ``blocks.3`` and
    everything under it), in graph order.

    Raises:
        UnknownBlobError: ``name`` is no parameter, op or module scope of the model.
        PlanError: ``name`` is a parameter that is no weight (see :func:`is_streamable`).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> streamable_parameters(model, "fc1")
        ['fc1.weight', 'fc1.bias']
    """
    inits = model.graph.initializers
    if name in inits:
        if not is_streamable(inits[name]):
            data = inits[name].const_value
            shown = f"{data.dtype.name}{list(data.shape)}" if data is not None else "no data"
            raise PlanError(
                f"initializer {name!r} ({shown}) cannot be streamed: only weights of at least one "
                "dimension, floating point or a quantized integer type, are (shapes, indices and "
                "scalars are read on the host while lowering)"
            )
        return [name]
    found: list[str] = []
    prefix = name + "."
    for node in model.graph:
        if node.metadata_props.get(COPY_KEY):
            continue
        scope = node_scope(node) or ""
        if node.name != name and scope != name and not scope.startswith(prefix):
            continue
        for value in node.inputs:
            if value is None or value.name not in inits or value.name in found:
                continue
            if is_streamable(value):
                found.append(value.name)
    if (
        not found
        and not model.has_op(name)
        and not any(
            (node_scope(n) or "") == name or (node_scope(n) or "").startswith(prefix) for n in model.graph
        )
    ):
        raise UnknownBlobError(f"{name!r} is no parameter, op or module scope of the model")
    return found


def stream_parameters(
    model: Model,
    names: Iterable[str],
    *,
    host: DeviceLike | None = "cpu",
    window: int | str | None = None,
) -> StreamResult:
    """Keep parameters in host memory and stream them to the devices that read them every run.

    Args:
        model: the model (changed in place; unchanged on any error).
        names: parameters, op names (their weights) or module scopes
            (``"blocks.3"``: every op under it), see :func:`streamable_parameters`.
        host: the device the parameters live on (``"cpu"``); ``None`` stops streaming them
            (they live at their first reader again).
        window: device memory for streamed weights in flight, in bytes or as ``"512MiB"``:
            runtimes prefetch the next streamed weights while it has room (at least the
            ones the next op needs). ``None`` keeps the recorded window (unset:
            double-buffering, room for the two largest consecutive streamed groups).

    If the model already has copies, they are re-injected (keeping its input and
    output devices) so that the streamed parameters are read through ``streamed``
    copies right away; otherwise :func:`~placement.inject_cross_device_copies` makes
    them later.

    Raises:
        UnknownBlobError: a name is no parameter, op or module scope.
        PlanError: a parameter named is no weight (an int64 shape, a scalar, see
            :func:`is_streamable`).
        DeviceError: ``host`` is malformed or not a CPU device.
        PlanError: ``window`` is malformed.

    Example:
        >>> import placement as pl
        >>> from placement.models import gpt
        >>> model = pl.from_torch(*gpt.build("tiny"))
        >>> result = pl.stream_parameters(model, ["blocks.1"], window="1MiB")
        >>> sorted(result.streamed)[:2], result.window
        (['blocks.1.attn.c_attn.bias', 'blocks.1.attn.c_attn.weight'], 1048576)
    """
    from placement.passes.copies import inject_cross_device_copies

    if isinstance(names, str):
        names = [names]
    target = Device.parse(host) if host is not None else None
    if target is not None and target.type != "cpu":
        raise DeviceError(f"streamed parameters live in host memory: host must be a CPU device, not {target}")
    wanted: list[str] = []
    for name in names:
        for param in streamable_parameters(model, name):
            if param not in wanted:
                wanted.append(param)
    limit = parse_bytes(window) if window is not None else None
    homes = streamed_homes(model.ir_model)
    result = StreamResult()
    for param in wanted:
        if target is None:
            if homes.pop(param, None) is not None:
                result.removed.append(param)
        elif homes.get(param) != target:
            homes[param] = target
            result.added.append(param)
    props = model.ir_model.metadata_props
    if homes:
        props[STREAMED_KEY] = json.dumps({name: str(dev) for name, dev in homes.items()})
    else:
        props.pop(STREAMED_KEY, None)
    if limit is not None:
        props[STREAM_WINDOW_KEY] = str(limit)
    if any(op.is_copy for op in model.iter_ops()):
        inject_cross_device_copies(model, input_device=model.input_device, output_device=model.output_device)
        result.copies_updated = True
    inits = model.graph.initializers
    result.streamed = homes
    result.bytes = sum(value_nbytes(inits[name]) or 0 for name in homes if name in inits)
    result.window = int(props[STREAM_WINDOW_KEY]) if props.get(STREAM_WINDOW_KEY) else None
    log.info(
        "stream_parameters: %d added, %d removed, %d streamed (%d bytes), window %s",
        len(result.added),
        len(result.removed),
        len(homes),
        result.bytes,
        result.window,
    )
    return result
