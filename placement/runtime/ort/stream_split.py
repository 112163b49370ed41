"""Streamed weights in ONNX Runtime: GPU stages cut so that each session is fed at most the window.

A streamed weight (:func:`placement.stream_parameters`) reaches a GPU stage as a stage
input: its host copy is transferred before the stage runs and freed after the stage's run
(the program frees each value after its last reader). A stage reading many streamed
weights would hold all of them on the device at once, whatever the window the plan counted.
So before a program is cut into stages, :func:`split_streamed` cuts each device's run of
ops into *segments* in graph order, starting a new one where the streamed weights its
ops read would exceed the window; each segment becomes its own stage (its own session),
and the program (:mod:`.program`) transfers a streamed weight right before the first
stage that reads it, not at the start of the run. The GPU then holds the streamed
weights of one segment at a time, at most the window (a single op reading more than the
window is a segment alone: it needs them all).

ONNX Runtime does not prefetch: a segment's weights are copied before it runs, not under
the compute of the segment before (the torch runtime's
:class:`~placement.runtime.torch.streaming.WeightStreamer` does overlap them).

The cut works on the runtime's private copy of the model: the segments are labelled with
private logical devices while the stages are cut (so the partitioner keeps them apart),
then :func:`restore_devices` gives the stages and transfers back their device.

Example:
    >>> import placement as pl
    >>> from placement.models import gpt
    >>> model = pl.from_torch(*gpt.build("tiny"))
    >>> _ = pl.stream_parameters(model, ["blocks.0", "blocks.1"], window="16KiB")
    >>> _ = pl.inject_cross_device_copies(model)
    >>> gpu = PhysicalDevice("cuda", 0)
    >>> back = split_streamed(model, {pl.Device("cuda", 0): gpu, pl.Device("cpu"): PhysicalDevice("cpu")})
    >>> len(back) > 1                       # the GPU's ops are cut into several segments
    True
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import onnx_ir as ir

from placement.graph.device import MAX_DEVICE_INDEX, Device
from placement.graph.model import Model
from placement.graph.nodes import COPY_KEY, is_copy_node, node_device, set_node_device, stream_window
from placement.planning.offload_layers import aligned
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.stages import Partition

__all__ = ["split_streamed", "restore_devices", "streamed_window"]

log = logging.getLogger(__name__)


def streamed_window(model: Model) -> int:
    """The window streamed weights are fed through: the recorded one, else twice the
    largest streamed weight (the torch streamer's default)."""
    window = stream_window(model.ir_model)
    if window is not None:
        return window
    sizes = [aligned(_nbytes(model, name)) for name in model.streamed]
    return 2 * max(sizes, default=0)


def _nbytes(model: Model, name: str) -> int:
    value = model.graph.initializers.get(name)
    data = value.const_value if value is not None else None
    return int(data.nbytes) if data is not None else 0


def _streamed_reads(node: ir.Node, copies: dict[ir.Value, int]) -> dict[ir.Value, int]:
    """The streamed copies ``node`` reads (value -> bytes)."""
    return {v: copies[v] for v in node.inputs if v is not None and v in copies}


def split_streamed(model: Model, device_map: Mapping[Device, PhysicalDevice]) -> dict[Device, Device]:
    """Label each segment of every device that streamed weights are copied to with a private
    logical device (see the module doc); returns private device -> the device it stands for
    (empty: nothing to cut). A device on the weights' own physical device is not cut (the
    copy is an alias there, it takes no memory), unless it is an emulated GPU. The model is
    changed in place: pass the runtime's private copy."""
    if not model.streamed:
        return {}
    window = streamed_window(model)
    copies: dict[ir.Value, int] = {}  # a streamed copy's output -> bytes
    copy_nodes: dict[ir.Value, ir.Node] = {}  # a streamed copy's output -> the copy
    for node in model.graph:
        if is_copy_node(node) and node.metadata_props.get(COPY_KEY) == "streamed":
            source = node.inputs[0]
            copies[node.outputs[0]] = aligned(_nbytes(model, source.name or "")) if source else 0
            copy_nodes[node.outputs[0]] = node
    devices = set()
    for node in copy_nodes.values():
        device, host = node_device(node), model.streamed.get(node.inputs[0].name or "")
        physical = device_map.get(device)
        if physical is None or host is None or physical != device_map.get(host) or physical.emulated:
            devices.add(device)
    back: dict[Device, Device] = {}
    current: dict[Device, tuple[Device, int, set[ir.Value]]] = {}  # device -> (segment, bytes, weights)
    labels: dict[ir.Node, Device] = {}
    for node in model.graph:
        device = node_device(node)
        if device not in devices or is_copy_node(node):
            continue
        reads = _streamed_reads(node, copies)
        segment, used, held = current.get(device, (None, 0, set()))
        new = {v: n for v, n in reads.items() if v not in held}
        extra = sum(new.values())
        if segment is None or (new and used and used + extra > window):
            segment = Device(device.type, MAX_DEVICE_INDEX - len(back))  # private: counts down
            back[segment] = device
            used, held = 0, set()
        held = held | set(new)
        current[device] = (segment, used + extra, held)
        labels[node] = segment
    if len(back) <= len(devices):
        return {}  # one segment per device: nothing to cut
    for node, segment in labels.items():
        set_node_device(node, segment)
    for node in model.graph:  # a copy to a cut device goes to its first reader's segment
        if is_copy_node(node) and node_device(node) in devices:
            readers = [labels[use.node] for use in node.outputs[0].uses() if use.node in labels]
            if readers:
                set_node_device(node, readers[0])
    log.info(
        "cut %d device(s) reading streamed weights into %d segments of at most %d streamed bytes",
        len(devices),
        len(back),
        window,
    )
    return back


def restore_devices(part: Partition, back: dict[Device, Device]) -> None:
    """Give the stages and transfers of ``part`` (cut from a model :func:`split_streamed`
    relabelled) their real logical devices back."""
    if not back:
        return
    for stage in part.stages:
        stage.device = back.get(stage.device, stage.device)
    part.transfers = [
        dataclasses.replace(
            t, device=back.get(t.device, t.device), src_device=back.get(t.src_device, t.src_device)
        )
        for t in part.transfers
    ]
    for mapping in (part.input_devices, part.output_devices):
        for name, device in mapping.items():
            mapping[name] = back.get(device, device)
