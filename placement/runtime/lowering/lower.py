"""Lower a placed model to PyTorch: ``to_torch(model) -> torch.fx.GraphModule``.

The ONNX graph is walked once in topological order and a ``torch.fx.Graph`` is
built by hand: a placeholder per graph input, ``get_attr`` for parameters and
constants, one ``call_function`` per op to its rule in
:data:`placement.runtime.lowering.ops.RULES`, and ``.to(device, non_blocking=True)``
for copies. The result is an ordinary ``torch.nn.Module`` with readable ``.code``
that supports autograd.

Where a rule offers a *direct* form and the instance allows it, the plain torch
call is emitted instead of the rule (``x.permute(0, 2, 1, 3)``,
``w[idx]``, ``F.layer_norm(x, (768,), w, b, 1e-05)``, ``x.masked_fill(mask, -inf)``),
so the code reads like hand-written torch and costs no wrapper call. The
exporter's split of ``nn.Linear`` into ``MatMul`` + ``Add`` (bias) is fused back
into ``F.linear`` (eager's single ``addmm``), using the weight itself when the
MatMul reads ``W.permute(1, 0)``. Static shapes come from the IR or, where the
exporter left a value without one, from running the rules on meta tensors.

Design choices:

* **Devices.** Every logical device goes through
  :func:`~placement.runtime.device_map.resolve_device_map`. Each value knows its
  logical device; an op on device ``d`` reads its inputs on ``d``'s physical
  device. Explicit copies (``Copy`` ops from ``inject_cross_device_copies``)
  always become ``.to(...)``. A cross-device edge *without* a copy also gets a
  ``.to(...)`` when the physical devices differ (logged at debug level), so
  unplaced-copy models lower correctly too. ``non_blocking=True`` is used except
  for GPU -> CPU copies, where it would let the CPU read unfinished data. Each
  emitted node records its op's logical device in ``node.meta["placement_device"]``
  (for splits by device).
* **Inputs and outputs.** Graph inputs are moved to their device on entry (a
  no-op when already there); graph outputs are moved to the model's output
  device when one is set. One output is returned as a tensor, several as a tuple.
* **Parameters.** Floating-point initializers with at least one dimension become
  ``nn.Parameter`` (``requires_grad=True``) on the physical device of their home
  logical device (``Model.parameters[name].device``), registered under their
  original dotted names (``blocks.0.attn.c_attn.bias`` -> submodule
  ``blocks.0.attn.c_attn``, parameter ``bias``). Static copies of a parameter
  stay ``.to(...)`` calls in ``forward``: free when the devices coincide, and a
  parameter used on two GPUs stays one ``nn.Parameter`` that training updates
  once (materializing per-device replicas would silently split it).
* **Constants.** Integer/bool initializers, 0-d initializers, BatchNorm running
  statistics (a rule's ``buffer_inputs``), ``Constant`` ops and
  everything computed only from them (shape arithmetic, and ``Shape`` of a value
  whose shape is static) are folded at lowering time. A folded constant is then
  inlined as a Python literal where the rule allows it (shapes, axes, scalars:
  ``reshape(x, [2, 8, 4, 8])``, ``x * 0.125``) or else registered as a buffer on
  each physical device that reads it (first device: the blob's name; others:
  ``<name>__<device>``).
* **Names.** Attribute paths are the ONNX names with each dot-separated part
  kept when it is a usable attribute name; otherwise (empty parts, a clash with
  an ``nn.Module`` attribute, or a name that is both a tensor and a prefix of
  another) the whole name is flattened with ``.`` -> ``_`` and made unique. The
  full mapping is ``module.initializer_paths`` (ONNX name -> attribute path).
  FX node names come from output blob names.

Example:
    >>> import torch
    >>> import placement as pl
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> x = torch.randn(3, 4)
    >>> model = pl.from_torch(net, (x,))
    >>> model.set_device(model.ops[-1].name, 1)  # last Gemm on logical cuda:1
    >>> module = pl.to_torch(model, device_map="cpu")
    >>> torch.allclose(module(x), net(x), atol=1e-6)
    True
    >>> sorted(name for name, _ in module.named_parameters())
    ['0.bias', '0.weight', '2.bias', '2.weight']
"""

from __future__ import annotations

import keyword
import logging
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
import torch.fx as fx

from placement.errors import CUDAGraphError, LoweringError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import COPY_KEY, DEVICE_KEY, is_copy_node, node_device, stream_window, subgraphs_of
from placement.runtime.device_map import DeviceMapLike, PhysicalDevice, resolve_device_map
from placement.runtime.lowering.ops import DEFAULT_RULE, Rule, get_rule, torch_dtype
from placement.runtime.lowering.streaming import STREAMER_NAME, WeightStreamer, pin_streamed

#: ``GraphModule.meta`` key whose attributes ``copy.deepcopy`` restores.
_PRESERVED = getattr(fx.graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY", "_user_preserved_attributes")

__all__ = ["to_torch", "check_supported", "MIN_OPSET", "UNTRACEABLE_META"]

log = logging.getLogger(__name__)

#: ``fx.Node.meta`` key: the name of the ONNX op a node was lowered from.
OP_META = "placement_op"
#: ``fx.Node.meta`` key: why a TorchScript trace must never record the node (control flow that
#: depends on tensor values, such as a ``Loop``'s trip count or an ``If``'s condition).
UNTRACEABLE_META = "placement_untraceable"

#: Oldest default-domain opset the rules implement (Softmax / Split semantics); older
#: models are converted to it with ``onnx.version_converter``.
MIN_OPSET = 13

#: Constants folded at lowering time larger than this many elements stay runtime ops.
_MAX_FOLD_NUMEL = 1 << 22
#: Largest constant inlined as a Python list into a shape-like input.
_MAX_INLINE_NUMEL = 64


def to_torch(
    model: Model,
    *,
    device_map: DeviceMapLike = "auto",
    chunks: int = 1,
    checkpoint: str = "except_last",
    batch_axes: Mapping[str, int | None] | None = None,
    cuda_graphs: bool = False,
) -> torch.nn.Module:
    """Lower a (placed) model to a ``torch.fx.GraphModule``.

    Args:
        model: the model; its ops may sit on several logical devices, with or
            without explicit copies.
        device_map: logical -> physical devices, see
            :func:`~placement.runtime.device_map.resolve_device_map` (``"auto"``:
            real GPUs when present, else every logical device emulated on the CPU).
        chunks: with ``chunks > 1``, return a pipelined module
            (:class:`~placement.runtime.lowering.pipelined.PipelinedModule`):
            its forward splits the batch into ``chunks`` micro-batches that run
            through the per-stage submodules concurrently (GPipe's fill-drain
            schedule, one worker per stage) and its backward runs the stages
            in reverse the same way; outputs and gradients equal the unsplit module's.
        checkpoint: with ``chunks > 1``: ``"always"``, ``"except_last"`` (the
            default, as GPipe) or ``"never"``: which micro-batches drop their
            activations in forward and recompute them in backward.
        batch_axes: input/output name -> batch axis, replacing the detection
            from the graph's symbolic batch dimension (see
            :func:`placement.runtime.pipeline.batch_axes`).
        cuda_graphs: with ``chunks=1``, return a
            :class:`~placement.runtime.lowering.cuda_graphs.CUDAGraphModule`: each run of
            ops on one GPU is captured as a CUDA graph per input shape and replayed
            (inference: with gradients enabled it runs eagerly); see
            :mod:`placement.runtime.lowering.cuda_graphs`.

    Returns:
        A ``torch.fx.GraphModule``: call it with the graph inputs (positionally in
        ``module.input_names`` order, or by keyword with those names made valid
        identifiers) to get the output tensor, or a tuple of tensors when the
        graph has several outputs. It also carries
        ``input_names``, ``output_names``, ``device_map`` (logical -> physical
        device strings) and ``initializer_paths``.

    Raises:
        LoweringError: op types without a rule (all of them, named with an
            example op each), unsupported attributes, or an opset older than 13 that
            ``onnx.version_converter`` cannot convert.
        DeviceError: a bad ``device_map``.
        CUDAGraphError: ``cuda_graphs=True`` without a GPU in the device map, or with ``chunks > 1``.

    The module (``chunks=1``) checks its inputs as :class:`placement.Runner` does: a
    wrong dtype, rank or static dimension raises :class:`placement.InputError`
    naming the input (see :mod:`placement.runtime.lowering.input_check`).

    Example:
        >>> import torch
        >>> import placement as pl
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Softmax(-1))
        >>> module = pl.to_torch(pl.from_torch(net, (torch.randn(1, 4),)), device_map="cpu")
        >>> print(module.code.strip().splitlines()[0])
        def forward(self, input):
    """
    if not isinstance(model, Model):
        raise TypeError(f"to_torch lowers a placement.Model, got {type(model).__name__}")
    if cuda_graphs and chunks != 1:
        raise CUDAGraphError(f"cuda_graphs=True runs the unpipelined module (chunks=1), got chunks={chunks}")
    model, problems = _upgraded(model)
    check_supported(model, problems=problems)
    devices = _logical_devices(model)
    dmap = resolve_device_map(devices, device_map, runtime="torch")
    module = _Lowering(model, dmap).build()
    if chunks == 1:  # a pipelined module's batch may be several graph batches: its stages check
        from placement.runtime.inputs import input_specs
        from placement.runtime.lowering.input_check import install_input_check

        specs = input_specs(model.graph)
        keywords = [str(n.target) for n in module.graph.nodes if n.op == "placeholder"][: len(specs)]
        install_input_check(module, specs, keywords)
    if chunks != 1:
        from placement.runtime.lowering.pipelined import pipeline_module

        return pipeline_module(model, module, chunks=chunks, checkpoint=checkpoint, batch_axes=batch_axes)
    if cuda_graphs:
        from placement.runtime.lowering.cuda_graphs import cuda_graph_module

        return cuda_graph_module(module)
    log.info(
        "lowered %d ops to torch on %s",
        model.graph.num_nodes(),
        ", ".join(f"{d}->{p}" for d, p in sorted(dmap.items())),
    )
    return module


def check_supported(model: Model, *, problems: list[str] | None = None) -> None:
    """Raise one ``LoweringError`` naming every op type and attribute the lowering cannot handle.

    ``problems`` are earlier findings (an opset conversion that failed) listed first.

    Example:
        >>> import torch
        >>> import placement as pl
        >>> model = pl.from_torch(torch.nn.ReLU(), (torch.randn(2),))
        >>> check_supported(model)  # fine: Relu has a rule
    """
    problems = list(problems or ())
    missing: dict[str, tuple[str, int]] = {}
    bad_attrs: dict[str, str] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):  # Loop/Scan bodies, If branches too
        rule = get_rule(node.op_type, node.domain)
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        if rule is DEFAULT_RULE:
            example, count = missing.get(key, (node.name or "?", 0))
            missing[key] = (example, count + 1)
            continue
        attrs = {name: _attr_python(attr) for name, attr in node.attributes.items()}
        unknown = sorted(set(attrs) - (rule.params or frozenset()))
        if unknown:
            bad_attrs.setdefault(f"{key}: attribute(s) {', '.join(unknown)}", node.name or "?")
        elif rule.check is not None:
            issue = rule.check(attrs)
            if issue:
                bad_attrs.setdefault(f"{key}: {issue}", node.name or "?")
    if missing:
        listed = "; ".join(
            f"{key} (e.g. op {example!r}{f', {count} ops' if count > 1 else ''})"
            for key, (example, count) in sorted(missing.items())
        )
        problems.append(f"unsupported op types: {listed}")
    if bad_attrs:
        listed = "; ".join(f"{what} (e.g. op {example!r})" for what, example in sorted(bad_attrs.items()))
        problems.append(f"unsupported attributes: {listed}")
    if problems:
        raise LoweringError("cannot lower to torch: " + " | ".join(problems))


def _default_opset(model: Model) -> int | None:
    imports = model.graph.opset_imports
    return imports.get("", imports.get("ai.onnx"))


def _upgraded(model: Model) -> tuple[Model, list[str]]:
    """The model itself, or a copy converted to opset :data:`MIN_OPSET` by ``onnx.version_converter``.

    Node names survive the conversion; devices, copy marks and scopes are copied
    back by name, and a node the converter added takes the device of a neighbour.
    Returns the model and the problems found (a failed conversion).
    """
    opset = _default_opset(model)
    if opset is None or opset >= MIN_OPSET:
        return model, []
    import onnx
    from onnx import version_converter

    proto = ir.serde.serialize_model(model.ir_model)
    try:
        converted = version_converter.convert_version(proto, MIN_OPSET)
        onnx.checker.check_model(converted)
    except Exception as err:  # the converter raises plain RuntimeErrors from C++
        reason = " ".join(str(err).split())[:200]
        return model, [f"default-domain opset {opset} could not be converted to {MIN_OPSET}: {reason}"]
    ir_model = ir.serde.deserialize_model(converted)
    ir_model.metadata_props.update(model.ir_model.metadata_props)
    by_name = {node.name: node for node in model.graph if node.name}
    unplaced: list[ir.Node] = []
    for node in ir_model.graph:
        source = by_name.get(node.name or "")
        if source is not None:
            node.metadata_props.update(source.metadata_props)
        else:
            unplaced.append(node)
    for node in unplaced:
        neighbours = [u.node for out in node.outputs for u in out.uses()]
        neighbours += [v.producer() for v in node.inputs if v is not None and v.producer() is not None]
        placed = next((n for n in neighbours if n is not None and DEVICE_KEY in n.metadata_props), None)
        if placed is not None:
            node.metadata_props[DEVICE_KEY] = placed.metadata_props[DEVICE_KEY]
    log.info("converted the model from opset %d to %d for the torch lowering", opset, MIN_OPSET)
    return Model(ir_model, device=_logical_devices(model)[0]), []


# --- internals -------------------------------------------------------------------------


def _logical_devices(model: Model) -> list[Device]:
    devices = set(model.devices) | set(model.streamed.values())
    for extra in (model.input_device, model.output_device):
        if extra is not None:
            devices.add(extra)
    return sorted(devices) or [Device("cuda", 0)]


def _attr_python(attr: ir.Attr) -> Any:
    """An attribute's value as plain Python (tensors as CPU torch tensors)."""
    kind = attr.type
    value = attr.value
    if kind == ir.AttributeType.FLOAT:
        return _short_float(value)
    if kind == ir.AttributeType.FLOATS:
        return [_short_float(v) for v in value]
    if kind == ir.AttributeType.INTS:
        return [int(v) for v in value]
    if kind == ir.AttributeType.TENSOR:
        return _to_torch_tensor(value)
    if kind == ir.AttributeType.STRINGS:
        return list(value)
    return value


def _short_float(value: float) -> float:
    """A float32 attribute at its shortest round-trip spelling (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _to_torch_tensor(tensor: Any) -> torch.Tensor:
    """An onnx_ir tensor (or numpy array) as a CPU torch tensor."""
    dtype_enum = getattr(tensor, "dtype", None)
    if isinstance(dtype_enum, ir.DataType):
        dtype = torch_dtype(int(dtype_enum))
        shape = [int(d) for d in tensor.shape]
        raw = tensor.tobytes()
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()
    return torch.from_numpy(np.array(tensor, copy=True))


_IDENT = re.compile(r"[^0-9a-zA-Z_]")

#: Attribute names a parameter or submodule may not take (they exist on every GraphModule).
_RESERVED = frozenset(dir(fx.GraphModule)) | frozenset(vars(torch.nn.Module())) | {
    "graph", "code", "meta", "input_names", "output_names", "device_map", "initializer_paths",
}  # fmt: skip


def _identifier(name: str, fallback: str = "v") -> str:
    """A valid Python identifier from a blob name (``blocks.0/x`` -> ``blocks_0_x``)."""
    text = _IDENT.sub("_", name).strip("_") or fallback
    if text[0].isdigit():
        text = f"_{text}"
    if keyword.iskeyword(text):
        text += "_"
    return text


@dataclass
class _Val:
    """A blob during lowering: a runtime fx node, a parameter, or a constant."""

    name: str
    node: fx.Node | None = None
    device: Device | None = None  # logical device of a runtime value / parameter home
    const: torch.Tensor | None = None
    param: str | None = None  # attribute path of an nn.Parameter

    @property
    def is_const(self) -> bool:
        return self.const is not None


class _Lowering:
    def __init__(self, model: Model, dmap: dict[Device, PhysicalDevice]) -> None:
        self.model = model
        self.dmap = dmap
        self.graph = fx.Graph()
        self.root = torch.nn.Module()
        self.values: dict[str, _Val] = {}
        self.paths: dict[str, str] = {}  # onnx initializer / constant name -> attribute path
        self.taken_paths: set[str] = set()
        self.prefixes: set[str] = set()
        self.cache: dict[tuple[str, str], fx.Node] = {}  # (blob, physical) -> node there
        self.pending_params: dict[str, torch.Tensor] = {}  # registered on first use
        self.device_override: Device | None = None  # the device of an inlined subgraph's ops
        self.deferred: dict[int, Any] = {}  # consumer node id -> continuation of a fused producer
        self.meta: dict[str, torch.Tensor] = {}  # blob -> meta tensor (static shape and dtype)
        self.fused: set[str] = set()  # blobs computed inside a fused call, never materialized
        self.const_homes: dict[str, str] = {}  # constant blob -> its first buffer path
        self.transient: set[str] = set()  # buffer paths left out of the state_dict
        self.default_device = next(iter(model.devices), Device("cuda", 0))
        self.current_device: Device | None = None  # logical device of the op being lowered
        self.current_op: str | None = None  # recorded on each fx node (its stage, when pipelining)
        self.streamer: WeightStreamer | None = None  # made at the first streamed copy
        self.streamer_path = ""
        self.streamed_sources: list[str] = []  # per streamed copy, its parameter's name

    # -- driver -----------------------------------------------------------------------------

    def build(self) -> fx.GraphModule:
        model = self.model
        self._inputs()
        self._initializers()
        for node in model.graph:
            self.current_op = node.name
            self._lower(node)
        self.current_op = None
        self._outputs()
        module = _graph_module(self.root, self.graph, "PlacedModule")
        if self.streamer is not None:
            paths = [self.paths[name] for name in self.streamed_sources]
            pin_streamed(module, sorted(set(paths)))
            self.streamer.bind([module.get_parameter(path) for path in paths])
        present = {name for name, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        for path in self.transient & present:
            owner, _, leaf = path.rpartition(".")
            module.get_submodule(owner)._non_persistent_buffers_set.add(leaf)
        extras = {
            "input_names": list(model.inputs),
            "output_names": list(model.outputs),
            "device_map": {str(k): str(v) for k, v in sorted(self.dmap.items())},
            "initializer_paths": {k: v for k, v in self.paths.items() if v in present},
        }
        for name, value in extras.items():
            setattr(module, name, value)
        module.meta.setdefault(_PRESERVED, {}).update(extras)  # survive copy.deepcopy
        return module

    def _phys(self, device: Device) -> str:
        return str(self.dmap[device])

    # -- inputs, parameters, constants ----------------------------------------------------

    def _inputs(self) -> None:
        inits = self.model.graph.initializers
        for value in self.model.graph.inputs:
            name = value.name or ""
            if name in inits:
                continue
            placeholder = self.graph.placeholder(_identifier(name, "input"))
            device = self.model.blob_device(value)
            phys = self._phys(device)
            self.current_device = device
            moved = self._create(
                "call_method",
                "to",
                (placeholder, phys),
                {"non_blocking": True},
                f"{placeholder.name}_on_{phys}",
            )
            self.values[name] = _Val(name, node=moved, device=device)

    def _initializers(self) -> None:
        params = self.model.parameters
        state = _state_initializers(self.model)
        for name, value in self.model.graph.initializers.items():
            tensor = value.const_value
            if tensor is None:
                raise LoweringError(f"initializer {name!r} has no data")
            data = _to_torch_tensor(tensor)
            trainable = data.is_floating_point() and data.dim() >= 1 and name not in state
            if trainable:
                home = params[name].device if name in params else self.default_device
                self.values[name] = _Val(name, device=home)
                self.pending_params[name] = data
            else:
                self.values[name] = _Val(name, const=data)

    def _attr_path(self, name: str) -> str:
        """A free attribute path for ``name`` (see the module docstring)."""
        parts = name.split(".")
        usable = all(p and p not in _RESERVED for p in parts)
        path = name if usable else ""
        clash = (
            not path
            or path in self.taken_paths
            or path in self.prefixes
            or any(".".join(parts[:i]) in self.taken_paths for i in range(1, len(parts)))
        )
        if clash:
            base = _identifier(name, "tensor")
            if base in _RESERVED:
                base += "_"
            path, k = base, 1
            while path in self.taken_paths or path in self.prefixes:
                path, k = f"{base}_{k}", k + 1
        self.taken_paths.add(path)
        split = path.split(".")
        self.prefixes.update(".".join(split[:i]) for i in range(1, len(split)))
        return path

    def _owner(self, path: str) -> tuple[torch.nn.Module, str]:
        """The module that holds attribute ``path`` (made on the way where missing) and its leaf name."""
        *prefix, leaf = path.split(".")
        owner = self.root
        for part in prefix:
            child = owner._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        return owner, leaf

    def _register(self, path: str, tensor: torch.Tensor, *, parameter: bool) -> None:
        owner, leaf = self._owner(path)
        if parameter:
            owner.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=True))
        else:
            owner.register_buffer(leaf, tensor)

    def _param_node(self, val: _Val) -> fx.Node:
        """The get_attr node of a parameter (registered on first use, on its home device)."""
        assert val.device is not None
        key = (val.name, "param")
        node = self.cache.get(key)
        if node is None:
            path = self._attr_path(val.name)
            data = self.pending_params.pop(val.name)
            self._register(path, data.to(self._phys(val.device)), parameter=True)
            self.paths[val.name] = path
            val.param = path
            node = self.graph.get_attr(path)
            self.cache[key] = node
            self.cache[(val.name, self._phys(val.device))] = node
        return node

    def _const_node(self, val: _Val, phys: str) -> fx.Node:
        """A buffer holding constant ``val`` on physical device ``phys``."""
        key = (val.name, phys)
        node = self.cache.get(key)
        if node is None:
            assert val.const is not None
            first = val.name not in self.const_homes
            path = self._attr_path(val.name if first else f"{val.name}__{phys.replace(':', '_')}")
            self._register(path, val.const.to(phys), parameter=False)
            if first:
                self.const_homes[val.name] = path
            if first and val.name in self.model.graph.initializers:
                self.paths[val.name] = path
            else:  # folded or per-device constants are rebuilt by lowering, not state
                self.transient.add(path)
            node = self.graph.get_attr(path)
            self.cache[key] = node
        return node

    # -- reading values ----------------------------------------------------------------

    def _value(self, value: ir.Value | None, op: ir.Node) -> _Val | None:
        if value is None or not value.name or value.name in self.fused:
            return None
        val = self.values.get(value.name)
        if val is None:
            raise LoweringError(
                f"op {op.name!r} ({op.op_type}) reads blob {value.name!r} before it is produced "
                "(the graph is not in topological order)"
            )
        return val

    def _on(self, val: _Val, phys: str) -> fx.Node:
        """The fx node of a non-constant value on physical device ``phys``."""
        if val.is_const:
            return self._const_node(val, phys)
        assert val.device is not None
        home = self._phys(val.device)
        source = self._param_node(val) if val.node is None else val.node
        if home == phys:
            return source
        key = (val.name, phys)
        node = self.cache.get(key)
        if node is None:
            log.debug("no explicit copy: moving blob %r from %s to %s", val.name, home, phys)
            node = self._emit_to(source, home, phys, f"{val.name}_to_{phys}")
            self.cache[key] = node
        return node

    def _emit_to(self, source: fx.Node, src_phys: str, dst_phys: str, name: str) -> fx.Node:
        blocking = src_phys.startswith("cuda") and dst_phys == "cpu"
        kwargs = {} if blocking else {"non_blocking": True}
        return self._create("call_method", "to", (source, dst_phys), kwargs, name)

    def _create(
        self, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str
    ) -> fx.Node:
        node = self.graph.create_node(op, target, args, kwargs, name=_identifier(name))
        if self.current_device is not None:  # lets a split by device find each node's device
            node.meta["placement_device"] = str(self.current_device)
        if self.current_op is not None:
            node.meta[OP_META] = self.current_op
        return node

    def _argument(self, val: _Val | None, index: int, rule: Rule, phys: str) -> Any:
        if val is None:
            return None
        if val.is_const:
            literal = _literal(val, index, rule)
            if literal is not _NOT_LITERAL:
                return literal
        return self._on(val, phys)

    # -- ops -------------------------------------------------------------------------------

    def _lower(self, node: ir.Node) -> None:
        ins = [self._value(v, node) for v in node.inputs]
        outs = list(node.outputs)
        device = self.device_override or node_device(node)
        phys = self._phys(device)
        self.current_device = device
        if is_copy_node(node) or (node.op_type == "Identity" and node.domain in ("", "ai.onnx")):
            self._lower_identity(node, ins[0], device, phys)
            return
        rule = get_rule(node.op_type, node.domain)
        attrs = {name: _attr_python(attr) for name, attr in node.attributes.items()}
        if "num_outputs" in (rule.params or ()) and "num_outputs" not in attrs:
            attrs["num_outputs"] = len(outs)
        if "device" in (rule.params or ()):
            attrs["device"] = phys
        continuation = self.deferred.pop(id(node), None)
        if continuation is not None:
            continuation(self, node, ins, phys)
            self._propagate(rule, ins, attrs, outs)
            return
        if self._fold(node, rule, ins, attrs, outs):
            return
        if rule.emit is not None and rule.emit(self, node, ins, phys):
            self._propagate(rule, ins, attrs, outs)
            return
        args = [self._argument(val, i, rule, phys) for i, val in enumerate(ins)]
        while args and args[-1] is None:
            args.pop()
        kwargs = self._kwargs(rule, attrs, phys)
        fx_op, target = "call_function", rule.fn
        if rule.widen_unsigned and any(v is not None and v.dtype in _WIDE_UNSIGNED for v in node.inputs):
            self._lower_widened(node, rule, args, kwargs, device)
            return
        if rule.direct is not None:
            shapes = [self._shape(v) for v in node.inputs]
            emitted = rule.direct(tuple(args), kwargs, shapes)
            if emitted is not None:
                fx_op, target, args, kwargs = emitted
        self._propagate(rule, ins, attrs, outs)
        if len(outs) == 1:
            name = outs[0].name or node.name or node.op_type
            call = self._create(fx_op, target, tuple(args), kwargs, name)
            self.values[outs[0].name or ""] = _Val(outs[0].name or "", node=call, device=device)
            return
        call = self._create(fx_op, target, tuple(args), kwargs, _op_label(node))
        for i, out in enumerate(outs):
            if out.name:
                item = self._create("call_function", operator.getitem, (call, i), {}, out.name)
                self.values[out.name] = _Val(out.name, node=item, device=device)

    def _lower_widened(
        self, node: ir.Node, rule: Rule, args: list[Any], kwargs: dict[str, Any], device: Device
    ) -> None:
        """Compute in int64 where torch has no uint16/32/64 kernel, then cast back."""
        label = _op_label(node)
        wide = [
            self._create("call_method", "to", (a, torch.int64), {}, f"{label}_in{i}_i64")
            if isinstance(a, fx.Node)
            else a
            for i, a in enumerate(args)
        ]
        out = node.outputs[0]
        name = out.name or label
        call = self._create("call_function", rule.fn, tuple(wide), kwargs, name)
        if out.dtype in _WIDE_UNSIGNED:
            call = self._create("call_method", "to", (call, torch_dtype(int(out.dtype))), {}, f"{name}_cast")
        self.values[out.name or ""] = _Val(out.name or "", node=call, device=device)

    # -- the interface of a rule's ``emit`` ------------------------------------------------------

    def shape(self, value: ir.Value | None) -> tuple[int, ...] | None:
        """The static shape of a blob, or None."""
        return self._shape(value)

    def on(self, val: _Val, phys: str) -> fx.Node:
        """The fx node of a value on physical device ``phys``."""
        return self._on(val, phys)

    def emit(self, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> fx.Node:
        """Append one fx node."""
        return self._create(op, target, args, kwargs, name)

    def define(self, blob: str, node: fx.Node, device: Device) -> None:
        """Record ``node`` as the value of ``blob`` on logical ``device``."""
        self.values[blob] = _Val(blob, node=node, device=device)

    def defer(self, consumer: ir.Node, continuation: Any) -> None:
        """Lower ``consumer`` with ``continuation(lowering, node, inputs, phys)`` instead of its rule."""
        self.deferred[id(consumer)] = continuation

    def constant(self, val: _Val | None) -> torch.Tensor | None:
        """The lowering-time value of an input, or None when it is computed at run time."""
        return None if val is None else val.const

    def inline(self, graph: ir.Graph, device: Device, outputs: list[ir.Value]) -> None:
        """Lower ``graph``'s ops in place on logical ``device``; its outputs become ``outputs``."""
        saved, self.device_override = self.device_override, device
        try:
            for initializer in graph.initializers.values():
                tensor = initializer.const_value
                if initializer.name and tensor is not None:
                    self.values[initializer.name] = _Val(initializer.name, const=_to_torch_tensor(tensor))
            for inner in graph:
                self._lower(inner)
        finally:
            self.device_override = saved
        for out, result in zip(outputs, graph.outputs):
            val = self._value(result, result.producer() or outputs[0].producer())
            if out.name and val is not None:
                self.values[out.name] = val

    def subgraphs(
        self, node: ir.Node, graphs: list[ir.Graph], phys: str
    ) -> tuple[list[fx.GraphModule], list[fx.Node]]:
        """Lower an op's subgraphs (a ``Loop``/``Scan`` body, both ``If`` branches) on its device.

        Each graph becomes its own ``GraphModule`` built by the same machinery,
        whose forward takes the graph's formal inputs followed by the values of
        the enclosing graph that the subgraphs read (their *captured* values, one
        list shared by all of ``graphs``) and returns a tuple of the graph's
        outputs. Captured values known when lowering are folded into the
        subgraph instead. Its initializers become its own parameters and buffers
        on ``phys``. Returns the modules and the fx nodes (on ``phys``) of the
        captured values, to pass after the formal inputs.
        """
        names = _captured(graphs)
        runtime: list[str] = []
        for name in names:
            val = self.values.get(name)
            if val is None or name in self.fused:
                raise LoweringError(
                    f"op {node.name!r} ({node.op_type}): its subgraph reads blob {name!r} of the "
                    "enclosing graph, which is not produced before it"
                )
            if not val.is_const:
                runtime.append(name)
        device = self.current_device or self.default_device
        modules = [_BodyLowering(self, graph, device, runtime, node).build() for graph in graphs]
        return modules, [self._on(self.values[name], phys) for name in runtime]

    def add_module(self, name: str, module: torch.nn.Module) -> str:
        """Register ``module`` under a free attribute path made from ``name``; return the path."""
        path = self._attr_path(_identifier(name, "control"))
        owner, leaf = self._owner(path)
        owner.add_module(leaf, module)
        return path

    def mark_fused(self, blob: str) -> None:
        """``blob`` is computed inside a fused call and never materialized."""
        self.fused.add(blob)

    # -- static shapes ------------------------------------------------------------------------

    def _shape(self, value: ir.Value | None) -> tuple[int, ...] | None:
        """The static shape of a blob: from the IR, else from meta propagation."""
        if value is None:
            return None
        shape = _static_shape(value)
        if shape is not None:
            return shape
        val = self.values.get(value.name or "")
        if val is not None and val.is_const:
            assert val.const is not None
            return tuple(val.const.shape)
        meta = self.meta.get(value.name or "")
        return tuple(meta.shape) if meta is not None else None

    def _meta_input(self, value: ir.Value | None, val: _Val | None, index: int, rule: Rule) -> Any:
        if val is None or value is None:
            return None
        if val.is_const:
            literal = _literal(val, index, rule)
            if literal is not _NOT_LITERAL:
                return literal
            assert val.const is not None
            return val.const.to("meta")
        meta = self.meta.get(val.name)
        if meta is None:
            shape = self._shape(value)
            if shape is None or value.dtype is None:
                raise LookupError(val.name)
            meta = torch.empty(shape, dtype=torch_dtype(int(value.dtype)), device="meta")
            self.meta[val.name] = meta
        return meta

    def _propagate(
        self, rule: Rule, ins: list[_Val | None], attrs: dict[str, Any], outs: list[ir.Value]
    ) -> None:
        """Record the outputs' shapes when the IR lacks them, by running the rule on meta tensors."""
        if all(_static_shape(out) is not None or not out.name for out in outs):
            return
        node_inputs = outs[0].producer().inputs if outs and outs[0].producer() is not None else ()
        try:
            args = [self._meta_input(v, val, i, rule) for i, (v, val) in enumerate(zip(node_inputs, ins))]
            if "device" in attrs:
                attrs = {**attrs, "device": "meta"}
            result = rule.fn(*args, **attrs)
        except Exception:  # unknown input shapes, or a rule that reads data: shapes stay unknown
            return
        results = result if len(outs) > 1 else (result,)
        for out, tensor in zip(outs, results):
            if out.name and isinstance(tensor, torch.Tensor):
                self.meta[out.name] = tensor if tensor.device.type == "meta" else tensor.to("meta")

    def _lower_identity(self, node: ir.Node, src: _Val | None, device: Device, phys: str) -> None:
        out = node.outputs[0].name or ""
        if src is None:
            raise LoweringError(f"op {node.name!r} ({node.op_type}) has no input")
        if src.is_const:  # a constant is materialized once per physical device, whatever copies it
            self.values[out] = src
            return
        if not is_copy_node(node):
            # a plain Identity: alias the value (moved if it crosses devices)
            if src.device is not None and self._phys(src.device) != phys:
                self.values[out] = _Val(out, node=self._on(src, phys), device=device)
            else:
                self.values[out] = _Val(out, node=src.node, device=src.device, param=src.param)
                if src.node is None:  # a parameter under another name
                    self.values[out] = src
            return
        assert src.device is not None
        source = self._param_node(src) if src.node is None else src.node
        if node.metadata_props.get(COPY_KEY) == "streamed" and src.node is None and src.param:
            moved = self._emit_streamed(source, src, phys, out)
        else:
            moved = self._emit_to(source, self._phys(src.device), phys, out)
        self.values[out] = _Val(out, node=moved, device=device)

    def _emit_streamed(self, source: fx.Node, src: _Val, phys: str, out: str) -> fx.Node:
        """A streamed copy: ``self.weight_streamer(param, index=k)`` (see :mod:`.streaming`)."""
        if self.streamer is None:
            self.streamer = WeightStreamer([], window=stream_window(self.model.ir_model))
            self.streamer_path = self.add_module(STREAMER_NAME, self.streamer)
        data = self.model.graph.initializers[src.name].const_value
        index = self.streamer.add(phys, int(data.nbytes) if data is not None else 0)
        self.streamed_sources.append(src.name)
        call = self._create("call_module", self.streamer_path, (source,), {"index": index}, out)
        # a trace would freeze a prefetched weight as a constant and drop the prefetching
        call.meta[UNTRACEABLE_META] = f"copy {out!r}: a streamed weight, copied and prefetched every run"
        return call

    def _fold(
        self, node: ir.Node, rule: Rule, ins: list[_Val | None], attrs: dict[str, Any], outs: list[ir.Value]
    ) -> bool:
        """Evaluate ``node`` now if its inputs are constants; True when folded."""
        if not rule.foldable:
            return False
        if node.op_type in ("Shape", "Size") and ins and ins[0] is not None and not ins[0].is_const:
            dims = self._shape(node.inputs[0])
            if dims is None:
                return False
            args: list[Any] = [torch.empty(dims, device="meta")]
        elif all(val is None or val.is_const for val in ins):
            args = [None if val is None else val.const for val in ins]
        else:
            return False
        if "device" in attrs:
            attrs = {**attrs, "device": "cpu"}
        try:
            with torch.no_grad():
                result = rule.fn(*args, **attrs)
        except LoweringError:
            raise
        except Exception as err:
            raise LoweringError(
                f"op {node.name!r} ({node.op_type}) failed on its constant inputs: {err}"
            ) from err
        results = result if len(outs) > 1 else (result,)
        if any(r.numel() > _MAX_FOLD_NUMEL for r in results if isinstance(r, torch.Tensor)):
            return False
        for out, tensor in zip(outs, results):
            if out.name:
                self.values[out.name] = _Val(out.name, const=torch.as_tensor(tensor).detach().cpu())
        return True

    def _kwargs(self, rule: Rule, attrs: dict[str, Any], phys: str) -> dict[str, Any]:
        defaults = rule.defaults()
        kwargs: dict[str, Any] = {}
        for name, value in attrs.items():
            if name in defaults and _same(defaults[name], value):
                continue
            if isinstance(value, torch.Tensor):  # tensor attributes become CPU buffers
                holder = _Val(f"{rule.op_type}_{name}", const=value)
                value = self._const_node(holder, "cpu")
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[name] = value
        return kwargs

    # -- outputs ----------------------------------------------------------------------------

    def _outputs(self) -> None:
        results: list[fx.Node] = []
        out_device = self.model.output_device
        for value in self.model.graph.outputs:
            val = self.values.get(value.name or "")
            if val is None:
                raise LoweringError(f"graph output {value.name!r} is never produced")
            self.current_device = out_device or val.device
            if out_device is not None:
                target = self._phys(out_device)
            elif val.device is not None:
                target = self._phys(val.device)
            else:
                target = self._phys(self.model.blob_device(value))
            results.append(self._on(val, target))
        self.graph.output(results[0] if len(results) == 1 else tuple(results))


class _BodyLowering(_Lowering):
    """Lowers one subgraph of an op (see :meth:`_Lowering.subgraphs`) into its own ``GraphModule``.

    Every op of the subgraph runs on the enclosing op's logical ``device``. Its
    forward takes the graph's formal inputs, then the ``captured`` values of the
    enclosing graph (already on ``device``), and returns a tuple of its outputs.
    """

    def __init__(
        self, parent: _Lowering, body: ir.Graph, device: Device, captured: list[str], owner: ir.Node
    ) -> None:
        super().__init__(parent.model, parent.dmap)
        self.body = body
        self.device_override = device
        self.default_device = device
        self.current_device = device
        self.current_op = parent.current_op
        self.captured = captured
        self.owner = owner
        for name in _captured([body]):  # folded values of the enclosing graph stay folded here
            val = parent.values.get(name)
            if val is not None and val.is_const:
                self.values[name] = _Val(name, const=val.const)

    def build(self) -> fx.GraphModule:
        device = self.default_device
        for value in self.body.inputs:
            placeholder = self.graph.placeholder(_identifier(value.name or "", "input"))
            self.values[value.name or ""] = _Val(value.name or "", node=placeholder, device=device)
        for name in self.captured:
            placeholder = self.graph.placeholder(_identifier(name, "captured"))
            self.values[name] = _Val(name, node=placeholder, device=device)
        state = {
            value.name
            for node in self.body
            for i in get_rule(node.op_type, node.domain).buffer_inputs
            if i < len(node.inputs) and (value := node.inputs[i]) is not None
        }
        for name, value in self.body.initializers.items():
            if value.const_value is None:
                raise LoweringError(
                    f"initializer {name!r} of a subgraph of op {self.owner.name!r} has no data"
                )
            data = _to_torch_tensor(value.const_value)
            if data.is_floating_point() and data.dim() >= 1 and name not in state:
                self.values[name] = _Val(name, device=device)
                self.pending_params[name] = data
            else:
                self.values[name] = _Val(name, const=data)
        for node in self.body:
            self._lower(node)
        phys = self._phys(device)
        results = []
        for value in self.body.outputs:
            val = self.values.get(value.name or "")
            if val is None:
                raise LoweringError(
                    f"op {self.owner.name!r} ({self.owner.op_type}): subgraph output {value.name!r} "
                    "is never produced"
                )
            results.append(self._on(val, phys))
        self.graph.output(tuple(results))
        module = _graph_module(self.root, self.graph, f"{self.owner.op_type}Body")
        present = {name for name, _ in module.named_buffers()}
        for path in self.transient & present:
            owner, _, leaf = path.rpartition(".")
            module.get_submodule(owner)._non_persistent_buffers_set.add(leaf)
        # its own initializers by name, and those of subgraphs inside it by their keys
        # (see placement.graph.nodes.subgraph_initializers); the enclosing op prefixes them
        module.initializer_paths = {
            name: path for name, path in self.paths.items() if name in self.body.initializers or "/" in name
        }
        return module


def _graph_module(root: torch.nn.Module, graph: fx.Graph, name: str) -> fx.GraphModule:
    """The ``GraphModule`` of ``graph``, without dead code (e.g. transposes absorbed by fused linears)."""
    module = fx.GraphModule(root, graph, class_name=name)
    if module.graph.eliminate_dead_code():  # needs the owning module to see call_module nodes
        module.recompile()
    module.graph.lint()
    return module


def _captured(graphs: list[ir.Graph]) -> list[str]:
    """Names of enclosing-graph values that ``graphs`` (or subgraphs in them) read, in first-read order."""
    found: dict[str, None] = {}
    for graph in graphs:
        defined = {v.name for v in graph.inputs} | set(graph.initializers)
        defined |= {out.name for node in graph for out in node.outputs}
        reads: list[str] = []
        for node in graph:
            reads += [v.name for v in node.inputs if v is not None and v.name]
            reads += _captured([sub for _, sub in subgraphs_of(node)])
        reads += [v.name for v in graph.outputs if v.name]
        for name in reads:
            if name not in defined:
                found.setdefault(name)
    return list(found)


def _op_label(node: ir.Node) -> str:
    """A readable name for a multi-output call: the op name without the exporter's ``node_``."""
    name = node.name or node.op_type
    return name[len("node_") :] if name.startswith("node_") and len(name) > 5 else name


def _state_initializers(model: Model) -> set[str]:
    """Initializers fed to a rule's ``buffer_inputs`` (e.g. BatchNorm running stats)."""
    inits = model.graph.initializers
    found: set[str] = set()
    for node in model.graph:
        positions = get_rule(node.op_type, node.domain).buffer_inputs
        for i in positions:
            if i < len(node.inputs):
                value = node.inputs[i]
                if value is not None and value.name in inits:
                    found.add(value.name)
    return found


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return type(a) is type(b) and a == b


def _static_shape(value: ir.Value) -> tuple[int, ...] | None:
    shape = value.shape
    if shape is None:
        return None
    dims = []
    for dim in shape:
        if not isinstance(dim, int):
            return None
        dims.append(int(dim))
    return tuple(dims)


_NOT_LITERAL = object()

#: Unsigned types without most torch kernels: rules flagged ``widen_unsigned`` compute them in int64.
_WIDE_UNSIGNED = frozenset({ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64})


def _literal(val: _Val, index: int, rule: Rule) -> Any:
    """A constant input written into the code as a Python literal (a shape list or a
    scalar), or ``_NOT_LITERAL`` when it stays a tensor."""
    data = val.const
    assert data is not None
    if index in rule.shape_inputs and data.dim() <= 1 and data.numel() <= _MAX_INLINE_NUMEL:
        return data.tolist()
    if index in rule.scalar_inputs and data.dim() == 0:
        return data.item()
    return _NOT_LITERAL
