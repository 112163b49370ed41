"""``Model``: an ``onnx_ir.Model`` plus placement state, in Caffe2's vocabulary.

The placement state lives in the IR itself, so that it survives every onnx_ir
operation and serialises with the model:

* each op (``onnx_ir.Node``) carries its device in ``metadata_props["placement.device"]``;
* a cross-device copy is an ``Identity`` node marked ``placement.copy``;
* the model may carry the device graph inputs are fed on and graph outputs are
  gathered on (``placement.input_device`` / ``placement.output_device``);
* *streamed* parameters live in host memory whatever device reads them
  (``placement.streamed``: a JSON object, parameter -> host device, and the
  prefetch window in bytes under ``placement.stream_window``); their copies to
  the device that reads them are marked ``streamed`` (made every run, prefetched).

Parameters (initializers) and graph inputs have no device of their own: a
parameter lives where its first consumer (in graph order) runs, a graph input
on the model's input device or, if unset, where its first consumer runs. That
derived rule keeps parameters next to the ops that use them whatever front-end
moved those ops.

Example:
    >>> import onnx_ir as ir
    >>> import placement as pl
    >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    >>> relu = ir.Node("", "Relu", [x], name="relu", num_outputs=1)
    >>> relu.outputs[0].name = "y"
    >>> graph = ir.Graph([x], relu.outputs, nodes=[relu], opset_imports={"": 20})
    >>> model = pl.Model(ir.Model(graph, ir_version=10))
    >>> model.set_device("relu", "cuda:1")
    >>> [(op.name, str(op.device)) for op in model.ops]
    [('relu', 'cuda:1')]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from placement.errors import UnknownBlobError, UnknownOpError
from placement.graph.device import Device, DeviceLike
from placement.graph.dims import dynamic_negative_dims
from placement.graph.kv_names import is_cache_input
from placement.graph.nodes import (
    COPY_KEY,
    DEVICE_KEY,
    INPUT_DEVICE_KEY,
    OUTPUT_DEVICE_KEY,
    is_copy_node,
    node_device,
    node_reads,
    node_scope,
    set_node_device,
    streamed_homes,
    subgraph_initializers,
)
from placement.graph.saving import save

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["Model", "Op", "Parameter", "value_nbytes", "iter_nodes"]

log = logging.getLogger(__name__)

# --- views -------------------------------------------------------------------------


class Op:
    """A read-mostly view of one operator: name, type, blobs, device, scope.

    Ops are views over ``onnx_ir.Node`` objects; they stay valid while the node
    is in the graph. Change devices through :meth:`Model.set_device`.
    """

    __slots__ = ("node",)

    def __init__(self, node: ir.Node) -> None:
        self.node = node

    @property
    def name(self) -> str:
        """The op's unique name."""
        return self.node.name or ""

    @property
    def op_type(self) -> str:
        """The ONNX op type, e.g. ``"Gemm"``."""
        return self.node.op_type

    @property
    def domain(self) -> str:
        """The ONNX domain ('' for the default domain)."""
        return self.node.domain

    @property
    def inputs(self) -> tuple[str, ...]:
        """Input blob names ('' marks an omitted optional input)."""
        return tuple(v.name or "" if v is not None else "" for v in self.node.inputs)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Output blob names."""
        return tuple(v.name or "" for v in self.node.outputs)

    @property
    def device(self) -> Device:
        """The logical device the op runs on."""
        return node_device(self.node)

    @property
    def scope(self) -> str | None:
        """Module path that produced the op (``"blocks.0.attn"``), or None."""
        return node_scope(self.node)

    @property
    def is_copy(self) -> bool:
        """True for cross-device copies inserted by ``inject_cross_device_copies``."""
        return is_copy_node(self.node)

    @property
    def is_static_copy(self) -> bool:
        """True for copies of parameters, which runtimes perform once at load time."""
        return self.node.metadata_props.get(COPY_KEY) == "static"

    @property
    def is_streamed_copy(self) -> bool:
        """True for copies of host-resident parameters made every run (see :func:`streamed_homes`)."""
        return self.node.metadata_props.get(COPY_KEY) == "streamed"

    def __repr__(self) -> str:
        return (
            f"Op({self.name!r}, {self.op_type}, in={list(self.inputs)}, "
            f"out={list(self.outputs)}, device={self.device})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Op) and other.node is self.node

    def __hash__(self) -> int:
        return id(self.node)


@dataclass(frozen=True)
class Parameter:
    """An initializer: name, shape, dtype, size in bytes and the device it lives on."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    device: Device


def value_nbytes(value: ir.Value, dims: Mapping[str, int] | None = None) -> int | None:
    """Bytes of a value with a known dtype and a static shape, else None.

    A symbolic dimension counts at its size in ``dims`` (symbol -> size, say
    ``{"batch": 8}``); one that ``dims`` does not give leaves the size unknown.

    Example:
        >>> x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 4]))
        >>> value_nbytes(x), value_nbytes(x, {"batch": 8})
        (None, 128.0)
    """
    if value.const_value is not None:
        return int(value.const_value.nbytes)
    shape, dtype = value.shape, value.dtype
    if shape is None or dtype is None:
        return None
    count = 1
    for dim in shape:
        if not isinstance(dim, int):
            size = dims.get(str(dim.value)) if dims and dim.value is not None else None
            if size is None:
                return None
            dim = size
        count *= dim
    return count * dtype.itemsize


# --- the model ---------------------------------------------------------------------


class Model:
    """An operator graph with named blobs and a device per op.

    Wraps an ``onnx_ir.Model`` (``model.ir_model``); every op without a device
    is placed on ``device``. Build one with :func:`placement.from_torch` or
    :func:`placement.load` rather than directly. Dimensions the file writes as
    ``-1`` (off the ONNX spec) become dynamic, with a warning
    (:func:`placement.graph.dims.dynamic_negative_dims`).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> net, args = mlp.build("tiny")
        >>> model = pl.from_torch(net, args)
        >>> model.devices
        [Device('cuda:0')]
    """

    def __init__(self, ir_model: ir.Model, *, device: DeviceLike = 0) -> None:
        if not isinstance(ir_model, ir.Model):
            raise TypeError(f"Model wraps an onnx_ir.Model, got {type(ir_model).__name__}")
        self.ir_model = ir_model
        dynamic_negative_dims(ir_model)  # -1 sizes (off the spec) are dynamic, as ONNX Runtime reads them
        default = str(Device.parse(device))
        for node in ir_model.graph:
            node.metadata_props.setdefault(DEVICE_KEY, default)
        self._op_index: dict[str, ir.Node] = {}
        self._value_index: dict[str, ir.Value] = {}

    # -- structure -------------------------------------------------------------------

    @property
    def graph(self) -> ir.Graph:
        """The underlying ``onnx_ir.Graph`` (nodes in topological order)."""
        return self.ir_model.graph

    @property
    def ops(self) -> list[Op]:
        """All ops in graph (topological) order."""
        return [Op(node) for node in self.graph]

    def iter_ops(self) -> Iterator[Op]:
        """Iterate over ops in graph order without building a list."""
        return (Op(node) for node in self.graph)

    def op(self, name: str) -> Op:
        """The op called ``name``.

        Raises:
            UnknownOpError: no op has that name.
        """
        return Op(self._node(name))

    def has_op(self, name: str) -> bool:
        """True if an op called ``name`` exists."""
        try:
            self._node(name)
        except UnknownOpError:
            return False
        return True

    @property
    def blobs(self) -> list[str]:
        """Every blob name: graph inputs, parameters, then op outputs in graph order."""
        names = [v.name for v in self.graph.inputs]
        names += [n for n in self.graph.initializers if n not in set(names)]
        for node in self.graph:
            names.extend(v.name for v in node.outputs if v.name)
        return [n for n in names if n]

    def value(self, name: str) -> ir.Value:
        """The ``onnx_ir.Value`` of blob ``name``.

        Raises:
            UnknownBlobError: no blob has that name.
        """
        value = self._value_index.get(name)
        if value is None or value.name != name or not self._value_in_graph(value):
            self._value_index = self._build_value_index()
            value = self._value_index.get(name)
            if value is None:
                raise UnknownBlobError(f"unknown blob {name!r}: no such value in the model")
        return value

    def has_blob(self, name: str) -> bool:
        """True if a blob called ``name`` exists."""
        try:
            self.value(name)
        except UnknownBlobError:
            return False
        return True

    @property
    def inputs(self) -> list[str]:
        """Graph input names (parameters excluded)."""
        inits = self.graph.initializers
        return [v.name or "" for v in self.graph.inputs if v.name not in inits]

    @property
    def outputs(self) -> list[str]:
        """Graph output names."""
        return [v.name or "" for v in self.graph.outputs]

    @property
    def parameters(self) -> dict[str, Parameter]:
        """Initializers by name, with shape, dtype, byte size and device."""
        first_device = self._first_consumer_devices()
        streamed = self.streamed
        params: dict[str, Parameter] = {}
        for name, value in self.graph.initializers.items():
            shape = tuple(int(d) for d in value.shape) if value.shape is not None else ()
            params[name] = Parameter(
                name=name,
                shape=shape,
                dtype=value.dtype.name if value.dtype is not None else "UNDEFINED",
                nbytes=value_nbytes(value) or 0,
                device=streamed.get(name) or first_device.get(name, self._default_device()),
            )
        return params

    @property
    def streamed(self) -> dict[str, Device]:
        """Streamed parameters: name -> their host device (see :func:`placement.stream_parameters`)."""
        return streamed_homes(self.ir_model)

    @property
    def devices(self) -> list[Device]:
        """The devices in use by ops, sorted."""
        return sorted({node_device(node) for node in self.graph})

    # -- devices ----------------------------------------------------------------------

    def device_of(self, name: str) -> Device:
        """The device of an op or a blob.

        A blob lives where its producer runs; a parameter where its first consumer
        runs; a graph input on the input device (or where its first consumer runs).

        Raises:
            UnknownBlobError: ``name`` is neither an op nor a blob.
        """
        node = self._op_index.get(name)
        if node is not None and node.name == name and node.graph is self.graph:
            return node_device(node)
        try:
            return node_device(self._node(name))
        except UnknownOpError:
            pass
        try:
            value = self.value(name)
        except UnknownBlobError:
            raise UnknownBlobError(f"unknown op or blob {name!r}") from None
        return self.blob_device(value)

    def blob_device(self, value: ir.Value) -> Device:
        """The device of an ``onnx_ir.Value`` (see :meth:`device_of`)."""
        producer = value.producer()
        if producer is not None:
            return node_device(producer)
        if (
            value.is_graph_input()
            and value.name not in self.graph.initializers
            and not is_cache_input(value.name)
        ):
            fixed = self.input_device
            if fixed is not None:
                return fixed
        if value.is_initializer():
            host = self.streamed.get(value.name or "")
            if host is not None:
                return host
        consumers = [use.node for use in value.uses() if use.node.graph is self.graph]
        if not consumers:
            inside = self._first_consumer_devices().get(value.name or "")  # read in a subgraph only
            return inside if inside is not None else self._output_or_default(value)
        if len(consumers) == 1:
            return node_device(consumers[0])
        positions = {id(node): i for i, node in enumerate(self.graph)}
        first = min(consumers, key=lambda n: positions.get(id(n), len(positions)))
        return node_device(first)

    def set_device(self, op_name: str, device: DeviceLike) -> None:
        """Place op ``op_name`` on ``device``.

        Raises:
            UnknownOpError: no such op (the model is unchanged).
            DeviceError: the device is malformed (the model is unchanged).
        """
        parsed = Device.parse(device)
        node = self._node(op_name)
        set_node_device(node, parsed)

    @property
    def input_device(self) -> Device | None:
        """Device graph inputs are fed on, once fixed by copy injection; else None."""
        spec = self.ir_model.metadata_props.get(INPUT_DEVICE_KEY)
        return Device.parse(spec) if spec else None

    @property
    def output_device(self) -> Device | None:
        """Device graph outputs are gathered on, once fixed by copy injection; else None."""
        spec = self.ir_model.metadata_props.get(OUTPUT_DEVICE_KEY)
        return Device.parse(spec) if spec else None

    def set_io_devices(
        self, input_device: DeviceLike | None = None, output_device: DeviceLike | None = None
    ) -> None:
        """Record the input/output devices (None clears the setting)."""
        props = self.ir_model.metadata_props
        for key, spec in ((INPUT_DEVICE_KEY, input_device), (OUTPUT_DEVICE_KEY, output_device)):
            if spec is None:
                props.pop(key, None)
            else:
                props[key] = str(Device.parse(spec))

    def device_state(self) -> dict[str, str]:
        """A snapshot of every op's device (op name -> device string)."""
        return {node.name or "": node.metadata_props.get(DEVICE_KEY, "") for node in self.graph}

    def restore_device_state(self, state: dict[str, str]) -> None:
        """Restore devices captured by :meth:`device_state` (used by transactional passes)."""
        for node in self.graph:
            spec = state.get(node.name or "")
            if spec:
                node.metadata_props[DEVICE_KEY] = spec

    def update_parameters(self, source: Any) -> list[str]:
        """Write trained weights back into the model's initializers (in place).

        ``source`` is a module lowered by ``pl.to_torch`` (plain or pipelined:
        its ``initializer_paths`` say where each initializer lives), any
        ``torch.nn.Module`` whose ``state_dict`` keys are initializer names
        (the module ``pl.from_torch`` imported, since initializers keep its
        parameter names), or a mapping ``initializer name -> array``. Only
        initializers are written; devices, ops and blobs are unchanged. All
        values are checked (shape, dtype) before any is written. Initializers of
        subgraphs (a ``Loop`` body's weights) are written too, under the keys of
        :func:`subgraph_initializers` (``"loop/body/w"``). Sessions of a
        :class:`~placement.runtime.ort.Runner` built before hold the old
        weights: build a new runner (or save and load) to serve the new ones.

        Returns:
            The names of the initializers written, in model order.

        Raises:
            UnknownBlobError: a mapping names something that is not an initializer.
            PlacementError: a value's shape or dtype differs from its initializer's.

        Example:
            >>> import torch
            >>> import placement as pl
            >>> net = torch.nn.Linear(3, 2)
            >>> model = pl.from_torch(net, (torch.randn(1, 3),))
            >>> with torch.no_grad():
            ...     _ = net.bias.fill_(0.5)
            >>> model.update_parameters(net)
            ['weight', 'bias']
            >>> model.graph.initializers["bias"].const_value.numpy().tolist()
            [0.5, 0.5]
        """
        import numpy as np

        from placement.errors import PlacementError

        inits: dict[str, ir.Value] = dict(self.graph.initializers)
        inits.update((key, value) for key, value, _ in subgraph_initializers(self.graph))
        values: dict[str, Any] = {}
        if hasattr(source, "state_dict") and callable(source.state_dict):
            state = source.state_dict()
            paths = getattr(source, "initializer_paths", None)
            for name in inits:
                key = paths.get(name) if isinstance(paths, dict) else name
                if key is not None and key in state:
                    values[name] = state[key]
        else:
            unknown = sorted(set(source) - set(inits))
            if unknown:
                raise UnknownBlobError(
                    f"update_parameters: {', '.join(map(repr, unknown[:5]))} "
                    f"{'is not an initializer' if len(unknown) == 1 else 'are not initializers'} of the model"
                )
            values = dict(source)
        arrays: dict[str, Any] = {}
        for name, value in values.items():
            if hasattr(value, "detach"):
                value = value.detach().cpu().numpy()
            array = np.asarray(value)
            init = inits[name]
            want_shape = tuple(int(d) for d in init.shape) if init.shape is not None else array.shape
            want_dtype = np.dtype(init.dtype.numpy()) if init.dtype is not None else array.dtype
            if array.shape != want_shape or array.dtype != want_dtype:
                raise PlacementError(
                    f"update_parameters: initializer {name!r} is {want_dtype}{list(want_shape)}, "
                    f"got {array.dtype}{list(array.shape)}"
                )
            arrays[name] = np.array(array, copy=True)
        for name, array in arrays.items():
            inits[name].const_value = ir.Tensor(array, name=inits[name].name)
        log.info("update_parameters: %d initializers written", len(arrays))
        return list(arrays)

    # -- views, copies, persistence ----------------------------------------------------

    def to_networkx(self) -> nx.DiGraph:
        """A networkx ``DiGraph`` of ops (see :func:`placement.graph.views.op_graph`)."""
        from placement.graph.views import op_graph

        return op_graph(self)

    def copy(self) -> Model:
        """A deep copy: a new IR model with the same ops, blobs, devices and metadata."""
        return Model(self.ir_model.clone())

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        external_data: bool | None = None,
        follow_symlinks: bool = False,
    ) -> None:
        """Save as standard ONNX with placement annotations (atomic; see :mod:`placement.graph.saving`).

        A symlink at ``path`` is replaced, not written through, unless ``follow_symlinks=True``.
        """
        save(self, path, external_data=external_data, follow_symlinks=follow_symlinks)

    def __repr__(self) -> str:
        return (
            f"Model(ops={self.graph.num_nodes()}, params={len(self.graph.initializers)}, "
            f"inputs={self.inputs}, outputs={self.outputs}, "
            f"devices={[str(d) for d in self.devices]})"
        )

    # -- internals ---------------------------------------------------------------------

    def _node(self, name: str) -> ir.Node:
        if not isinstance(name, str):
            raise UnknownOpError(f"op names are strings, got {name!r}")
        node = self._op_index.get(name)
        if node is None or node.name != name or node.graph is not self.graph:
            self._op_index = {n.name: n for n in self.graph if n.name}
            node = self._op_index.get(name)
            if node is None:
                raise UnknownOpError(f"unknown op {name!r}: no op of that name in the model")
        return node

    def _build_value_index(self) -> dict[str, ir.Value]:
        index: dict[str, ir.Value] = {}
        for value in self.graph.inputs:
            if value.name:
                index[value.name] = value
        index.update(self.graph.initializers)
        for node in self.graph:
            for value in node.outputs:
                if value.name:
                    index[value.name] = value
        return index

    def _value_in_graph(self, value: ir.Value) -> bool:
        producer = value.producer()
        if producer is not None:
            return producer.graph is self.graph
        return value.is_graph_input() or value.is_initializer()

    def _default_device(self) -> Device:
        for node in self.graph:
            return node_device(node)
        return Device("cuda", 0)

    def _output_or_default(self, value: ir.Value) -> Device:
        if value.is_graph_output() and self.output_device is not None:
            return self.output_device
        return self._default_device()

    def _first_consumer_devices(self) -> dict[str, Device]:
        """Blob name -> device of its first consumer in graph order (an op whose subgraphs read
        a blob of this graph consumes it too)."""
        first: dict[str, Device] = {}
        for node in self.graph:
            device = None
            for value in node_reads(node, self.graph):
                if value.name and value.name not in first:
                    device = device or node_device(node)
                    first[value.name] = device
        return first


def iter_nodes(model: Model) -> Iterable[ir.Node]:
    """The model's IR nodes in graph order."""
    return iter(model.graph)
