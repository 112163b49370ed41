"""ONNX Runtime's own ops: files that ONNX Runtime runs although ``onnx.checker`` has no schema.

Files built by ONNX Runtime's ecosystem (onnxruntime-genai's model builder, Olive,
ORT's transformer optimizer) hold ORT's ops: some in the default domain
(``SimplifiedLayerNormalization``), most in ``com.microsoft``
(``SkipSimplifiedLayerNormalization``, ``GroupQueryAttention``, ``MatMulNBits``...).
``onnx.checker`` refuses the first kind ("No Op registered") and does not look at
the second. Where onnx has no schema, ONNX Runtime decides:

* with ORT's schema registry (``get_all_operator_schema`` in its Python binding,
  detected, not assumed), each such node is checked against ORT's schema: the
  op exists at the model's opset, its input and output counts fit, its required
  attributes are set and it sets no attribute the schema lacks;
* without it, an ``InferenceSession`` build of the model decides (:func:`session_decides`).

:func:`checkable` returns the proto that ``onnx.checker`` then checks: the nodes ORT
vouched for move to a private domain, which the checker leaves alone, so everything
else (the graph's structure, the standard ops) is still checked.

Example:
    >>> import onnx
    >>> from onnx import helper
    >>> node = helper.make_node("SimplifiedLayerNormalization", ["x", "s"], ["y"], epsilon=1e-5)
    >>> graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, [2, 4]),
    ...     helper.make_tensor_value_info("s", 1, [4])], [helper.make_tensor_value_info("y", 1, [2, 4])])
    >>> proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    >>> onnx.checker.check_model(checkable(proto, origin="example"))  # ORT's op: checked by ORT's schema
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import onnx

from placement.errors import ModelLoadError

__all__ = [
    "checkable",
    "ort_schema",
    "has_ort_registry",
    "ORT_CHECKED_DOMAIN",
    "session_decides",
    "ort_only_ops",
]

log = logging.getLogger(__name__)

#: The private domain that nodes checked against ORT's schemas take in the checker's copy.
ORT_CHECKED_DOMAIN = "placement.ort_checked"
#: Domains ONNX Runtime defines ops in beside ONNX's own.
_ORT_DOMAINS = ("com.microsoft", "com.microsoft.nchwc", "com.ms.internal.nhwc", "com.microsoft.dml")
_ONNX_DOMAINS = ("", "ai.onnx")


@functools.lru_cache(maxsize=1)
def _registry() -> dict[tuple[str, str], list[Any]] | None:
    """ORT's op schemas by (domain, op type), newest first; ``None`` where the binding lacks them."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as state
    except ImportError:
        return None
    get_all = getattr(state, "get_all_operator_schema", None)
    if get_all is None:
        return None
    table: dict[tuple[str, str], list[Any]] = {}
    for schema in get_all():
        domain = "" if schema.domain == "ai.onnx" else schema.domain
        table.setdefault((domain, schema.name), []).append(schema)
    for schemas in table.values():
        schemas.sort(key=lambda s: -s.since_version)
    return table


def has_ort_registry() -> bool:
    """Whether the installed ONNX Runtime exposes its op schema registry."""
    return _registry() is not None


def ort_schema(op_type: str, domain: str, opset: int) -> Any | None:
    """ORT's schema of ``domain::op_type`` in force at ``opset``, or ``None``."""
    table = _registry()
    if table is None:
        return None
    domain = "" if domain == "ai.onnx" else domain
    for schema in table.get((domain, op_type), []):
        if schema.since_version <= opset and not schema.deprecated:
            return schema
    return None


@functools.lru_cache(maxsize=4096)
def _onnx_knows(op_type: str, domain: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return False
    return True


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _nodes(sub)


def _opsets(proto: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in proto.opset_import}


def ort_only_node(node: Any, opsets: Mapping[str, int]) -> bool:
    """Whether an ``onnx_ir`` node is one of ONNX Runtime's own ops (see :func:`ort_only_ops`)."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    if domain in _ORT_DOMAINS:
        return True
    return domain == "" and not _onnx_knows(node.op_type, "", opsets.get("", opsets.get("ai.onnx", 1)))


def ort_only_ops(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes onnx's checker cannot vouch for but ONNX Runtime may run.

    Default-domain nodes that onnx has no schema for at the model's opset, and
    nodes of ORT's own domains (``com.microsoft``...).
    """
    opsets = _opsets(proto)
    found = []
    for node in _nodes(proto.graph):
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain in _ORT_DOMAINS:
            found.append(node)
        elif domain == "" and not _onnx_knows(node.op_type, "", opsets.get("", 1)):
            found.append(node)
    return found


def _check_against(node: onnx.NodeProto, schema: Any, origin: str) -> None:
    """Raise ``ModelLoadError`` where ``node`` does not fit ORT's ``schema``."""
    what = f"{origin}: op {node.name!r} ({node.domain or 'ai.onnx'}::{node.op_type})"
    inputs = len(node.input)
    while inputs and not node.input[inputs - 1]:
        inputs -= 1
    if inputs < schema.min_input or inputs > schema.max_input:
        raise ModelLoadError(
            f"{what} has {inputs} inputs; ONNX Runtime's schema takes "
            f"{schema.min_input} to {schema.max_input}"
        )
    outputs = len(node.output)
    if outputs < schema.min_output or outputs > schema.max_output:
        raise ModelLoadError(
            f"{what} has {outputs} outputs; ONNX Runtime's schema gives "
            f"{schema.min_output} to {schema.max_output}"
        )
    given = {a.name for a in node.attribute}
    unknown = sorted(given - set(schema.attributes))
    if unknown:
        raise ModelLoadError(f"{what} sets attribute(s) {unknown} that ONNX Runtime's schema does not have")
    missing = sorted(n for n, a in schema.attributes.items() if a.required and n not in given)
    if missing:
        raise ModelLoadError(f"{what} lacks required attribute(s) {missing}")


def checkable(proto: onnx.ModelProto, *, origin: str) -> onnx.ModelProto:
    """``proto`` for ``onnx.checker``, ORT's ops checked against ORT's schemas.

    Nodes that onnx has no schema for and ORT's registry vouches for take a private
    domain in a copy (the given proto is not changed); without ORT's registry they
    are left to :func:`session_decides`. A default-domain node that neither onnx nor
    ORT knows is left as it is, for the checker to refuse. An op of ORT's domains
    that ORT does not know, or that does not fit ORT's schema, raises here.

    Raises:
        ModelLoadError: names the op and what ORT's schema says.
    """
    found = ort_only_ops(proto)
    if not found:
        return proto
    opsets = _opsets(proto)
    vouched: set[int] = set()
    registry = has_ort_registry()
    for node in found:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if not registry:
            vouched.add(id(node))  # a session build decides (session_decides)
            continue
        schema = ort_schema(node.op_type, domain, opsets.get(domain, 1))
        if schema is None:
            if domain == "":
                continue  # unknown to both: the checker names it
            raise ModelLoadError(
                f"{origin}: op {node.name!r} ({domain}::{node.op_type}) is not an op ONNX Runtime knows "
                f"at opset {opsets.get(domain, 1)} of {domain!r}"
            )
        _check_against(node, schema, origin)
        vouched.add(id(node))
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    originals = list(_nodes(proto.graph))
    moved = False
    for original, node in zip(originals, _nodes(copy.graph)):
        if id(original) in vouched:
            node.domain = ORT_CHECKED_DOMAIN
            moved = True
    if moved and ORT_CHECKED_DOMAIN not in opsets:
        copy.opset_import.add(domain=ORT_CHECKED_DOMAIN, version=1)
    return copy


def session_decides(model: Any, *, origin: str) -> None:
    """Without ORT's registry: build an ``InferenceSession`` of ``model`` (a
    :class:`~placement.graph.model.Model`); ORT's refusal becomes ``ModelLoadError``."""
    import onnxruntime as ort

    from placement.graph.session import ort_session

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort_session(model, options, ["CPUExecutionProvider"])
    except Exception as err:  # ORT raises its own types (Fail, InvalidGraph, ...)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(
            f"{origin} holds ops onnx does not know, and ONNX Runtime refuses it: {first}"
        ) from err
