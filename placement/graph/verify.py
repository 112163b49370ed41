"""``verify``: the invariants of a placed model.

1. every op has a (well-formed) device;
2. ops are in topological order: each input is a graph input, a parameter, or
   the output of an earlier op;
3. every edge whose ends sit on different devices goes through a copy, and no
   copy is redundant (a copy's source and destination devices differ); a read of
   a blob from inside an op's subgraph (a ``Loop`` body reading an outer value) is
   an edge to that op; a streamed parameter lives on its host device and every
   copy of it is marked ``streamed`` (and only such copies are);
4. graph outputs sit on the model's output device, when one is set;
5. tensor-parallel invariants: a partial sum (an op marked ``placement.tensor_parallel =
   partial``) feeds only all-reduces (through copies), a shard never reaches a graph output, and
   every collective tag is well formed;
6. the model is valid ONNX (``onnx.checker``), unless ``check_onnx=False``.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> pl.verify(model)
    >>> model.set_device(model.ops[-1].name, 1)
    >>> pl.verify(model)
    Traceback (most recent call last):
    ...
    placement.errors.VerificationError: ...
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import CheckerPass

try:  # the helper onnx_ir's CheckerPass uses: hands a proto without weights to onnx's C API
    from onnx_ir.passes.common import _c_api_utils
except ImportError:  # pragma: no cover - other onnx_ir releases
    _c_api_utils = None  # type: ignore[assignment]

from placement.errors import ModelLoadError, VerificationError
from placement.graph.device import Device
from placement.graph.external_data import _without_external_data
from placement.graph.kv_names import is_cache_input, is_cache_output
from placement.graph.model import Model
from placement.graph.nodes import (
    COPY_KEY,
    COPY_KINDS,
    DEVICE_KEY,
    SUBGRAPH_OP_TYPES,
    TP_KEY,
    collective_tag,
    is_copy_node,
    node_reads,
)
from placement.graph.ort_ops import checkable

__all__ = ["verify", "run_onnx_checker"]


def verify(model: Model, *, check_onnx: bool = True) -> None:
    """Check the invariants of a placed model; raise on the first broken op.

    Raises:
        VerificationError: names the first op that breaks an invariant.
    """
    graph = model.graph
    inits = graph.initializers
    input_device = model.input_device
    devices: dict[int, Device] = {}
    defined: set[int] = {id(v) for v in graph.inputs} | {id(v) for v in inits.values()}
    home: dict[int, Device] = {}  # parameters / graph inputs: device of first consumer
    streamed: set[int] = set()
    for name, host in model.streamed.items():  # streamed parameters live on their host
        if name in inits:
            home[id(inits[name])] = host
            streamed.add(id(inits[name]))
    for node in graph:
        spec = node.metadata_props.get(DEVICE_KEY)
        if spec is None:
            raise VerificationError(f"op {node.name!r} ({node.op_type}) has no device")
        try:
            device = Device.parse(spec)
        except Exception as err:
            raise VerificationError(f"op {node.name!r} has a bad device {spec!r}: {err}") from err
        copy = is_copy_node(node)
        reads = node_reads(node, graph) if node.op_type in SUBGRAPH_OP_TYPES else node.inputs
        for value in reads:
            if value is None:
                continue
            if id(value) not in defined:
                raise VerificationError(
                    f"op {node.name!r} reads blob {value.name!r} before it is produced "
                    "(ops are not in topological order, or the blob has no producer)"
                )
            source = _source_device(value, devices, home, inits, input_device, device)
            if copy:
                if source == device:
                    raise VerificationError(
                        f"copy {node.name!r} is redundant: blob {value.name!r} is already on {device}"
                    )
            elif source != device:
                raise VerificationError(
                    f"op {node.name!r} on {device} reads blob {value.name!r} from {source} without a copy"
                )
        if copy and (len(node.inputs) != 1 or len(node.outputs) != 1):
            raise VerificationError(f"copy {node.name!r} must have one input and one output")
        if copy:
            _check_copy_kind(node, streamed)
        for value in node.outputs:
            defined.add(id(value))
            devices[id(value)] = device
    output_device = model.output_device
    if output_device is not None:
        for value in graph.outputs:
            producer = value.producer()
            if (
                producer is not None
                and devices.get(id(value)) != output_device
                and not is_cache_output(value.name)
            ):
                raise VerificationError(
                    f"op {producer.name!r} produces graph output {value.name!r} on "
                    f"{devices.get(id(value))}, not on the output device {output_device}"
                )
    _check_tensor_parallel(graph)
    if check_onnx:
        run_onnx_checker(model)


def _readers(value: ir.Value) -> list[ir.Node]:
    """The ops reading ``value``, looking through copies."""
    found: list[ir.Node] = []
    for use in value.uses():
        if is_copy_node(use.node):
            for out in use.node.outputs:
                found += _readers(out)
        else:
            found.append(use.node)
    return found


def _reaches_output(value: ir.Value) -> bool:
    if value.is_graph_output():
        return True
    return any(
        is_copy_node(use.node) and any(_reaches_output(o) for o in use.node.outputs) for use in value.uses()
    )


def _check_tensor_parallel(graph: ir.Graph) -> None:
    """Partial sums feed only all-reduces; shards never reach graph outputs; tags parse."""
    for node in graph:
        collective_tag(node)  # raises on a malformed tag
        role = node.metadata_props.get(TP_KEY)
        if role is None:
            continue
        for value in node.outputs:
            if _reaches_output(value):
                raise VerificationError(
                    f"op {node.name!r} makes {role} blob {value.name!r}, which reaches a graph output "
                    "(a shard or partial sum must be gathered or reduced first)"
                )
            if role != "partial":
                continue
            for reader in _readers(value):
                tag = collective_tag(reader)
                if tag is None or tag["kind"] != "all_reduce":
                    raise VerificationError(
                        f"partial sum {value.name!r} (op {node.name!r}) is read by {reader.name!r} "
                        f"({reader.op_type}), not by an all-reduce"
                    )


def _check_copy_kind(node: ir.Node, streamed: set[int]) -> None:
    """A copy's kind is known, and ``streamed`` exactly for copies of streamed parameters."""
    kind = node.metadata_props.get(COPY_KEY)
    if kind not in COPY_KINDS:
        raise VerificationError(
            f"copy {node.name!r} has an unknown kind {kind!r}; expected one of {COPY_KINDS}"
        )
    source = node.inputs[0]
    is_streamed = source is not None and id(source) in streamed
    if is_streamed != (kind == "streamed"):
        what = "streamed parameter" if is_streamed else "blob that is not a streamed parameter"
        raise VerificationError(
            f"copy {node.name!r} of {what} {source.name if source is not None else None!r} is marked {kind!r}"
        )


def _source_device(
    value: ir.Value,
    devices: dict[int, Device],
    home: dict[int, Device],
    inits: dict[str, ir.Value],
    input_device: Device | None,
    consumer_device: Device,
) -> Device:
    found = devices.get(id(value))
    if found is not None:
        return found
    found = home.get(id(value))
    if found is None:
        is_input = value.is_graph_input() and value.name not in inits and not is_cache_input(value.name)
        found = input_device if (is_input and input_device is not None) else consumer_device
        home[id(value)] = found
    return found


def run_onnx_checker(model: Model | ir.Model) -> None:
    """Run ``onnx.checker`` on the model without serialising its weights.

    The checker is handed a proto whose initializers are stripped to their types
    (onnx_ir's ``call_onnx_api``, as its ``CheckerPass`` does), so the check costs
    no copy of the weights and works above protobuf's 2 GiB; tensors still held
    as external data are emptied in that proto too (the checker would look for
    their files in the working directory). ONNX Runtime's own ops are checked
    against ORT's schemas (:mod:`placement.graph.ort_ops`).

    Raises:
        VerificationError: the model is not valid ONNX (the checker's first line is quoted).
    """
    ir_model = model.ir_model if isinstance(model, Model) else model

    def check(proto: onnx.ModelProto) -> None:
        onnx.checker.check_model(checkable(_without_external_data(proto), origin="the model"))

    try:
        if _c_api_utils is not None and hasattr(_c_api_utils, "call_onnx_api"):
            _c_api_utils.call_onnx_api(check, ir_model)
        else:  # an onnx_ir without the helper: its checker pass
            CheckerPass()(ir_model)
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "invalid"
        raise VerificationError(f"the model is not valid ONNX: {first}") from err
    except ModelLoadError as err:
        raise VerificationError(f"the model is not valid ONNX: {err}") from err
