"""Graph builders and checkers for pass tests (reusable by runtime tests).

* :class:`GraphBuilder`: tiny hand-built graphs with named ops, blobs and devices;
* :func:`chain`: a chain of ``n`` ops, each with its own parameter or not;
* :func:`random_dag` / :func:`dags`: random DAGs with random devices, from a
  ``random.Random`` or as a hypothesis strategy (``st.data()`` free);
* :func:`run_ort` / :func:`feeds_for`: run a model in one plain ONNX Runtime session;
* :func:`run_placed` / :func:`churn`: run it placed (``pl.run``), then allocate
  other memory, so outputs that alias released buffers are caught;
* :func:`check_copies`: ``verify`` plus the exact copy invariants of the pass trio.

All tensors are float32 of one shape (``SHAPE``) so any op can read any blob.

Example:
    >>> from tests.passes.helpers import GraphBuilder
    >>> b = GraphBuilder()
    >>> x = b.input("x")
    >>> y = b.op("Relu", [x], "relu", device=1)
    >>> b.output(y)
    >>> model = b.build()
    >>> [str(op.device) for op in model.ops]
    ['cuda:1']
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

import placement as pl
from placement.graph import to_proto
from placement.graph.nodes import COPY_KEY, DEVICE_KEY

SHAPE = (2, 3)
UNARY = ("Tanh", "Sigmoid", "Neg", "Relu", "Abs")
BINARY = ("Add", "Sub", "Mul")
DEVICES = ("cuda:0", "cuda:1", "cuda:2", "cpu")


def tensor_value(name: str, shape: Sequence[int] = SHAPE) -> ir.Value:
    """A float32 value with a static shape."""
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(list(shape)))


class GraphBuilder:
    """Build a small ONNX graph op by op; every op has a name and a device."""

    def __init__(self, seed: int = 0) -> None:
        self.inputs: list[ir.Value] = []
        self.params: list[ir.Value] = []
        self.nodes: list[ir.Node] = []
        self.outputs: list[ir.Value] = []
        self.rng = np.random.default_rng(seed)

    def input(self, name: str, shape: Sequence[int] = SHAPE) -> ir.Value:
        value = tensor_value(name, shape)
        self.inputs.append(value)
        return value

    def param(self, name: str, shape: Sequence[int] = SHAPE, *, data: np.ndarray | None = None) -> ir.Value:
        array = data if data is not None else self.rng.standard_normal(shape).astype(np.float32)
        value = tensor_value(name, array.shape)
        value.const_value = ir.tensor(array, name=name)
        self.params.append(value)
        return value

    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        name: str,
        *,
        device: Any = 0,
        outputs: Sequence[str] | None = None,
        shapes: Sequence[Sequence[int] | None] | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> Any:
        """Add an op; returns its output value (or a tuple when it has several)."""
        names = list(outputs) if outputs is not None else [name]
        out_shapes = list(shapes) if shapes is not None else [SHAPE] * len(names)
        values = []
        for out, shape in zip(names, out_shapes):
            value = ir.Value(name=out, type=ir.TensorType(ir.DataType.FLOAT))
            if shape is not None:
                value.shape = ir.Shape(list(shape))
            values.append(value)
        attrs = [ir.convenience.convert_attribute(k, v) for k, v in (attributes or {}).items()]
        node = ir.Node(
            "",
            op_type,
            list(inputs),
            attrs,
            outputs=values,
            name=name,
            metadata_props={DEVICE_KEY: str(pl.Device.parse(device))},
        )
        self.nodes.append(node)
        return values[0] if len(values) == 1 else tuple(values)

    def output(self, *values: ir.Value) -> None:
        self.outputs.extend(values)

    def build(self) -> pl.Model:
        graph = ir.Graph(
            self.inputs,
            self.outputs,
            nodes=self.nodes,
            initializers=self.params,
            opset_imports={"": 20},
            name="test",
        )
        return pl.Model(ir.Model(graph, ir_version=10))


def chain(n: int, *, devices: Sequence[Any] | None = None, params: bool = True) -> pl.Model:
    """``x -> op0 -> ... -> op{n-1} -> h{n-1}``: even ops ``Add`` a parameter ``w{i}``, odd ops ``Tanh``.

    Op ``i`` is named ``op{i}``, produces ``h{i}``, and runs on ``devices[i]`` (default 0).
    """
    b = GraphBuilder()
    h = b.input("x")
    for i in range(n):
        device = devices[i] if devices is not None else 0
        if i % 2 == 0 and params:
            h = b.op("Add", [h, b.param(f"w{i}")], f"op{i}", outputs=[f"h{i}"], device=device)
        else:
            h = b.op("Tanh", [h], f"op{i}", outputs=[f"h{i}"], device=device)
    b.output(h)
    return b.build()


def random_dag(
    rng: random.Random,
    *,
    max_ops: int = 12,
    devices: Sequence[str] = DEVICES,
    num_devices: int | None = None,
    dead_ends: bool = False,
) -> pl.Model:
    """A random DAG of unary/binary elementwise ops over inputs, parameters and earlier blobs.

    Some ops read parameters only (data-independent blobs), some blobs feed several
    ops, some ops are graph outputs and also read inside; devices are random. With
    ``dead_ends`` some unread blobs are left out of the graph outputs (dead ops).
    """
    pool = list(devices[: num_devices or len(devices)])
    b = GraphBuilder(seed=rng.randrange(2**31))
    values: list[ir.Value] = [b.input(f"in{i}") for i in range(rng.randint(1, 2))]
    values += [b.param(f"p{i}") for i in range(rng.randint(0, 3))]
    produced: list[ir.Value] = []
    for i in range(rng.randint(1, max_ops)):
        device = rng.choice(pool)
        if rng.random() < 0.5:
            op_type, args = rng.choice(UNARY), [rng.choice(values)]
        else:
            op_type, args = rng.choice(BINARY), [rng.choice(values), rng.choice(values)]
        out = b.op(op_type, args, f"n{i}", outputs=[f"v{i}"], device=device)
        values.append(out)
        produced.append(out)
    unread = [v for v in produced if not any(v in node.inputs for node in b.nodes)]
    if dead_ends:
        unread = [v for v in unread if rng.random() < 0.5]
    extra = rng.sample(produced, k=min(len(produced), rng.randint(0, 2)))
    outputs = list(dict.fromkeys([produced[-1], *unread, *extra]))
    b.output(*outputs)
    return b.build()


def dags(**kwargs: Any) -> Any:
    """Hypothesis strategy of :func:`random_dag` models (shrinks through the seed)."""
    from hypothesis import strategies as st

    return st.builds(lambda seed: random_dag(random.Random(seed), **kwargs), st.integers(0, 2**32 - 1))


def feeds_for(model: pl.Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 inputs for every graph input of ``model``."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.inputs:
        if value.is_initializer():
            continue
        shape = [int(d) for d in value.shape] if value.shape is not None else list(SHAPE)
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def run_ort(model: pl.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``model`` as one plain ONNX Runtime CPU session (copies are ``Identity``)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def churn() -> None:
    """Allocate and free memory of many sizes, so an output array that aliases a
    released buffer gets overwritten before it is compared (call it between a run
    and the comparison of its outputs). Released ``OrtValue`` s go by reference
    counting, so no garbage collection is needed (a full one costs ~0.2 s here)."""
    junk = [np.full(n, 7.0, np.float32) for n in (1, 2, 3, 4, 6, 8, 16, 64, 256, 4096) for _ in range(20)]
    junk += [np.full(n, 7, np.int64) for n in (1, 2, 3, 6, 64) for _ in range(20)]
    del junk


def run_placed(model: pl.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``model`` with :func:`placement.run` (one emulated session per stage, real
    copies between logical devices), then :func:`churn`: compare the result afterwards."""
    outputs = pl.run(model, feeds, device_map="cpu")
    churn()
    return outputs


def assert_same_outputs(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    """Outputs equal within float tolerance (call after :func:`churn`, see :func:`run_placed`)."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


def origin_of(value: ir.Value) -> ir.Value:
    """The blob a copy chain copies (the value itself if it is no copy output)."""
    producer = value.producer()
    while producer is not None and COPY_KEY in producer.metadata_props:
        value = producer.inputs[0]
        producer = value.producer()
    return value


def check_copies(model: pl.Model) -> None:
    """``verify`` plus: copies read original blobs, one per (blob, device), none unused."""
    pl.verify(model)
    seen: dict[tuple[int, pl.Device], str] = {}
    for op in model.ops:
        if not op.is_copy:
            continue
        node = op.node
        source = node.inputs[0]
        assert origin_of(source) is source, f"copy {op.name} reads another copy"
        key = (id(source), op.device)
        assert key not in seen, f"copies {seen[key]} and {op.name} both copy {source.name} to {op.device}"
        seen[key] = op.name
        out = node.outputs[0]
        assert out.uses() or out.is_graph_output(), f"copy {op.name} is unused"
        expected = "static" if source.is_initializer() and not source.is_graph_input() else "dynamic"
        assert node.metadata_props[COPY_KEY] == expected, f"copy {op.name} is not marked {expected}"


def snapshot(model: pl.Model) -> bytes:
    """The model's full serialised form (graph, names, devices, metadata) for "unchanged" checks."""
    return ir.serde.serialize_model(model.ir_model).SerializeToString(deterministic=True)


def copy_ops(model: pl.Model) -> list[tuple[str, str, str, str]]:
    """``(source blob, copy blob, device, kind)`` for every copy, in graph order."""
    return [
        (op.inputs[0], op.outputs[0], str(op.device), op.node.metadata_props[COPY_KEY])
        for op in model.ops
        if op.is_copy
    ]


def devices_of(model: pl.Model) -> dict[str, str]:
    """Op name -> device string for non-copy ops."""
    return {op.name: str(op.device) for op in model.ops if not op.is_copy}
