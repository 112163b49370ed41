"""Loading placed models from ONNX files, protos and ``onnx_ir`` models.

``load`` restores the placement :mod:`placement.graph.saving` wrote (node
``metadata_props`` first, then ONNX's multi-device fields) and leaves external
weights on disk: they are ``onnx_ir`` external tensors, memory-mapped when a
runtime first reads them. Every path the file names is confined to the model's
folder first (:mod:`placement.graph.external_data`).

Example:
    >>> import placement as pl
    >>> from placement.graph.saving import to_proto
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> load(to_proto(model), device="cuda:1").devices == model.devices  # devices kept
    True
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Union

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from placement.errors import ModelLoadError
from placement.graph.device import Device, DeviceLike
from placement.graph.external_data import _check_data_pairing, _check_external_data, _without_external_data
from placement.graph.genai_config import apply_genai_config
from placement.graph.model import Model
from placement.graph.nodes import DEVICE_KEY
from placement.graph.ort_ops import checkable, has_ort_registry, ort_only_ops, session_decides
from placement.graph.saving import DATA_CHECK_KEY, TWO_GB

__all__ = ["load"]

log = logging.getLogger(__name__)

ModelSource = Union[str, os.PathLike, onnx.ModelProto, ir.Model, Model]


def load(source: ModelSource, *, device: DeviceLike = 0, initializers_as_inputs: bool = False) -> Model:
    """Load a model from an ONNX file, an ``onnx.ModelProto`` or an ``onnx_ir.Model``.

    Devices saved by :func:`save` are restored exactly; ops that carry none take
    the device stage from ONNX's multi-device fields if present, else ``device``.
    External data must lie inside the model's folder; it is not read here: the
    weights stay on disk and are memory-mapped when a runtime first reads them.
    A model saved by :func:`save` with external data is checked against its data
    file's header, so it never pairs with another save's weights.

    Models written for IR version 3 (old converters) list every initializer as a
    graph input too. They are normalised: initializers are parameters, not
    inputs (as from IR version 4 on), so runtimes treat them as constants. Pass
    ``initializers_as_inputs=True`` to keep such inputs listed. Dimensions
    written as ``-1`` (which ONNX Runtime reads as unknown) are read as dynamic,
    with one warning naming them (:func:`placement.graph.dims.dynamic_negative_dims`).

    Raises:
        ModelLoadError: the file is missing, truncated, not ONNX, or its
            external data is missing, too short, from another save or points
            outside its folder (subgraphs included; the message names the
            tensor and the op).

    Example:
        >>> import placement as pl
        >>> pl.load("does-not-exist.onnx")
        Traceback (most recent call last):
        ...
        placement.errors.ModelLoadError: no such model file: 'does-not-exist.onnx'
    """
    if isinstance(source, Model):
        model = source.copy()
    elif isinstance(source, ir.Model):
        model = _from_ir(source, device)
    elif isinstance(source, onnx.ModelProto):
        model = _from_proto(source, device, origin="the given ModelProto")
    elif isinstance(source, (str, os.PathLike)):
        model = _from_path(Path(source), device)
    else:
        raise ModelLoadError(
            f"cannot load a model from {type(source).__name__}: give a path, onnx.ModelProto or onnx_ir.Model"
        )
    if not initializers_as_inputs:
        _initializers_off_inputs(model)
    return model


def _initializers_off_inputs(model: Model) -> None:
    """Drop initializers from the graph inputs (IR version 3 style), keeping input order."""
    graph = model.graph
    listed = [v for v in graph.inputs if v.name in graph.initializers]
    for value in listed:
        graph.inputs.remove(value)
    if listed:
        if model.ir_model.ir_version < 4:
            model.ir_model.ir_version = 4
        log.info(
            "%d initializers were also graph inputs (IR version 3 style): now parameters only", len(listed)
        )


#: How often :func:`load` re-reads a model file that a concurrent save replaced.
_LOAD_ATTEMPTS = 5


def _from_path(path: Path, device: DeviceLike) -> Model:
    """Read, check and build a model file. A save that replaces the file (and retires
    its data file) while it is being read makes the checks of the old pair fail: the
    file is then read again, so a load sees the old pair or the new one, never a mix."""
    for attempt in range(_LOAD_ATTEMPTS):
        proto, identity = _read_model_file(path)
        try:
            _check_external_data(proto, path)
            _check_data_pairing(proto, path)
        except ModelLoadError:
            if attempt + 1 < _LOAD_ATTEMPTS and _file_identity(path) != identity:
                log.debug("%s was replaced while it was read; reading it again", path)
                continue
            raise
        return _from_proto(proto, device, origin=repr(str(path)), path=path)
    raise AssertionError("unreachable")  # pragma: no cover


def _file_identity(path: Path) -> tuple[int, ...] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _read_model_file(path: Path) -> tuple[onnx.ModelProto, tuple[int, ...]]:
    """Parse a model file (read once, through one descriptor) and say which file it was."""
    if not path.exists():
        raise ModelLoadError(f"no such model file: {str(path)!r}")
    if not path.is_file():
        raise ModelLoadError(f"not a file: {str(path)!r}")
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if info.st_size >= TWO_GB:
                raise ModelLoadError(
                    f"{str(path)!r} is {info.st_size} bytes, over protobuf's 2 GB limit: save its weights as "
                    "external data (onnx.save_model(..., save_as_external_data=True))"
                )
            data = f.read()
    except OSError as err:
        raise ModelLoadError(f"cannot read {str(path)!r}: {err}") from err
    if not data:
        raise ModelLoadError(f"{str(path)!r} is empty, not an ONNX model")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeWarning, ValueError) as err:
        raise ModelLoadError(f"{str(path)!r} is not a valid ONNX file (truncated or corrupt): {err}") from err
    return proto, (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _from_proto(
    proto: onnx.ModelProto, device: DeviceLike, *, origin: str, path: Path | None = None
) -> Model:
    if not proto.HasField("graph") or not proto.opset_import:
        raise ModelLoadError(f"{origin} is not an ONNX model (no graph or opset); is the file truncated?")
    _sort_nodes(proto.graph, origin)
    try:
        # The proto that was parsed is checked (never the file again: a concurrent save may
        # have replaced it); external data locations were checked by _check_external_data.
        # ORT's own ops are checked against ORT's schemas (placement.graph.ort_ops).
        onnx.checker.check_model(checkable(_without_external_data(proto), origin=origin))
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "invalid model"
        raise ModelLoadError(f"{origin} is not valid ONNX (truncated or corrupt?): {first}") from err
    except ValueError as err:  # > 2 GB protos: checked piecewise by ORT later
        log.debug("skipping onnx.checker for %s: %s", origin, err)
    stages = _stage_devices(proto)
    try:
        ir_model = ir.serde.deserialize_model(proto)
    except Exception as err:  # onnx_ir raises several types on malformed protos
        raise ModelLoadError(f"cannot read {origin}: {err}") from err
    if path is not None:  # external tensors stay on disk, memory-mapped when first read
        ir.external_data.set_base_dir(ir_model.graph, path.parent)
    ir_model.metadata_props.pop(DATA_CHECK_KEY, None)
    model = _from_ir(ir_model, device, stages)
    if path is not None:  # a cache's sizes that onnxruntime-genai's files leave symbolic
        apply_genai_config(model, path.parent)
    if not has_ort_registry() and ort_only_ops(proto):
        session_decides(model, origin=origin)
    return model


def _sort_nodes(graph: onnx.GraphProto, origin: str) -> None:
    """Put the nodes of ``graph`` (and its subgraphs) in topological order, in place.

    ONNX requires the order but ONNX Runtime does not, so such files exist. Nodes
    already in order keep it (a stable sort by position); a cycle is left for the
    checker to report.
    """
    import networkx as nx

    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _sort_nodes(sub, origin)
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    edges: list[tuple[int, int]] = []
    in_order = True
    for i, node in enumerate(graph.node):
        for name in _names_used(node):
            j = producer.get(name)
            if j is not None and j != i:
                edges.append((j, i))
                in_order = in_order and j < i
    if in_order:
        return
    dag = nx.DiGraph(edges)
    dag.add_nodes_from(range(len(graph.node)))
    try:
        order = list(nx.lexicographical_topological_sort(dag))
    except nx.NetworkXUnfeasible:
        return
    nodes = [graph.node[i] for i in order]
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(copies, nodes):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)
    log.debug("%s: nodes of graph %r were not in topological order; sorted them", origin, graph.name)


def _names_used(node: onnx.NodeProto) -> Iterator[str]:
    """The value names a node reads: its inputs and, from its subgraphs, outer-scope names."""
    yield from (name for name in node.input if name)
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            for inner in sub.node:
                yield from _names_used(inner)


def _stage_devices(proto: onnx.ModelProto) -> dict[str, str]:
    """Node name -> device from ONNX multi-device fields (for files made elsewhere)."""
    if "configuration" not in proto.DESCRIPTOR.fields_by_name:  # onnx < 1.18 reads no such fields
        return {}
    configs = {c.name: list(c.device) for c in proto.configuration}
    result: dict[str, str] = {}
    for node in proto.graph.node:
        for ndc in node.device_configurations:
            names = configs.get(ndc.configuration_id)
            if names and ndc.HasField("pipeline_stage") and 0 <= ndc.pipeline_stage < len(names):
                try:
                    result[node.name] = str(Device.parse(names[ndc.pipeline_stage]))
                except Exception:  # a device name we do not understand: ignore the field
                    continue
                break
    return result


def _from_ir(ir_model: ir.Model, device: DeviceLike, stages: dict[str, str] | None = None) -> Model:
    from onnx_ir.passes.common import NameFixPass

    NameFixPass()(ir_model)
    if stages:
        for node in ir_model.graph:
            if DEVICE_KEY not in node.metadata_props and node.name in stages:
                node.metadata_props[DEVICE_KEY] = stages[node.name]
    for node in ir_model.graph:
        spec = node.metadata_props.get(DEVICE_KEY)
        if spec is not None:
            try:
                Device.parse(spec)
            except Exception as err:
                raise ModelLoadError(f"op {node.name!r} has a bad device annotation {spec!r}: {err}") from err
    return Model(ir_model, device=device)
