"""Lowering one op at a time: folding, rules, direct forms, shapes, and the interface of a rule's ``emit``.

:meth:`Walker._lower` turns one ONNX node into fx nodes: a copy or ``Identity``
becomes an alias or a ``.to(...)``; an op whose inputs are all known is folded into a
constant; a rule's own ``emit`` may write the nodes (fused linears, control flow);
otherwise one ``call_function`` of the rule (or of its *direct* torch form). Static
shapes the IR lacks are found by running the rule on meta tensors. The public
methods (``shape``, ``on``, ``emit``, ``define``, ``defer``, ``constant``, ``inline``,
``add_module``, ``mark_fused``, and ``subgraphs`` from :mod:`.bodies`) are what a rule's
``emit`` may call.

Example:
    >>> import torch
    >>> import placement as pl
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU())
    >>> code = pl.to_torch(pl.from_torch(net, (torch.randn(1, 4),)), device_map="cpu").code
    >>> "linear" in code and "relu" in code
    True
"""

from __future__ import annotations

import operator
from typing import Any

import onnx_ir as ir
import torch
import torch.fx as fx

from placement.errors import LoweringError
from placement.graph.device import Device
from placement.graph.model import COPY_KEY, is_copy_node, node_device
from placement.lowering.emit import Emitter
from placement.lowering.ops import Rule, get_rule, torch_dtype
from placement.lowering.opset import MIN_OPSET, default_opset
from placement.lowering.values import (
    NOT_LITERAL,
    Val,
    attr_python,
    literal,
    op_label,
    same_value,
    static_shape,
    to_torch_tensor,
)

__all__ = ["Walker"]

#: Constants folded at lowering time larger than this many elements stay runtime ops.
MAX_FOLD_NUMEL = 1 << 22

#: Unsigned types without most torch kernels: rules flagged ``widen_unsigned`` compute them in int64.
WIDE_UNSIGNED = frozenset({ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64})


#: The dtypes a host op widens to fp32 (CPU kernels of these round where a GPU's accumulate).
HALF = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


class Walker(Emitter):
    """Lowers ops one by one onto the :class:`~.emit.Emitter`'s graph (see the module docstring)."""

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
        attrs = {name: attr_python(attr) for name, attr in node.attributes.items()}
        if "num_outputs" in (rule.params or ()) and "num_outputs" not in attrs:
            attrs["num_outputs"] = len(outs)
        if "device" in (rule.params or ()):
            attrs["device"] = phys
        if "opset" in (rule.params or ()):
            attrs["opset"] = default_opset(self.model) or MIN_OPSET
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
        narrow = self._widen_on_host(node, device, args)
        fx_op, target = "call_function", rule.fn
        if rule.widen_unsigned and any(v is not None and v.dtype in WIDE_UNSIGNED for v in node.inputs):
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
            call = self._narrow(call, outs[0], narrow)
            self.values[outs[0].name or ""] = Val(outs[0].name or "", node=call, device=device)
            return
        call = self._create(fx_op, target, tuple(args), kwargs, op_label(node))
        for i, out in enumerate(outs):
            if out.name:
                item = self._create("call_function", operator.getitem, (call, i), {}, out.name)
                item = self._narrow(item, out, narrow)
                self.values[out.name] = Val(out.name, node=item, device=device)

    def _widen_on_host(self, node: ir.Node, device: Device, args: list[Any]) -> bool:
        """Host ops compute in fp32: fp16 / bf16 inputs of an op on a ``cpu`` device are widened
        in place in ``args`` (``.float()``); True when its outputs are to be narrowed back."""
        if device.type != "cpu":
            return False
        widened = False
        for i, value in enumerate(node.inputs):
            if i < len(args) and isinstance(args[i], fx.Node) and value is not None and value.dtype in HALF:
                args[i] = self._create("call_method", "float", (args[i],), {}, f"{op_label(node)}_in{i}_f32")
                widened = True
        return widened

    def _narrow(self, call: fx.Node, out: ir.Value, narrow: bool) -> fx.Node:
        """The output of a widened host op back in its graph dtype."""
        if not narrow or out.dtype not in HALF:
            return call
        dtype = torch_dtype(int(out.dtype))
        return self._create("call_method", "to", (call, dtype), {}, f"{out.name or 'out'}_narrow")

    def _lower_widened(
        self, node: ir.Node, rule: Rule, args: list[Any], kwargs: dict[str, Any], device: Device
    ) -> None:
        """Compute in int64 where torch has no uint16/32/64 kernel, then cast back."""
        label = op_label(node)
        wide = [
            self._create("call_method", "to", (a, torch.int64), {}, f"{label}_in{i}_i64")
            if isinstance(a, fx.Node)
            else a
            for i, a in enumerate(args)
        ]
        out = node.outputs[0]
        name = out.name or label
        call = self._create("call_function", rule.fn, tuple(wide), kwargs, name)
        if out.dtype in WIDE_UNSIGNED:
            call = self._create("call_method", "to", (call, torch_dtype(int(out.dtype))), {}, f"{name}_cast")
        self.values[out.name or ""] = Val(out.name or "", node=call, device=device)

    def _lower_identity(self, node: ir.Node, src: Val | None, device: Device, phys: str) -> None:
        out = node.outputs[0].name or ""
        if src is None:
            raise LoweringError(f"op {node.name!r} ({node.op_type}) has no input")
        if src.is_const:  # a constant is materialized once per physical device, whatever copies it
            self.values[out] = src
            return
        if not is_copy_node(node):
            # a plain Identity: alias the value (moved if it crosses devices)
            if src.device is not None and self._phys(src.device) != phys:
                self.values[out] = Val(out, node=self._on(src, phys), device=device)
            else:
                self.values[out] = Val(out, node=src.node, device=src.device, param=src.param)
                if src.node is None:  # a parameter under another name
                    self.values[out] = src
            return
        assert src.device is not None
        source = self._param_node(src) if src.node is None else src.node
        if node.metadata_props.get(COPY_KEY) == "streamed" and src.node is None and src.param:
            moved = self._emit_streamed(source, src, phys, out)
        else:
            moved = self._emit_to(source, self._phys(src.device), phys, out)
        self.values[out] = Val(out, node=moved, device=device)

    def _fold(
        self, node: ir.Node, rule: Rule, ins: list[Val | None], attrs: dict[str, Any], outs: list[ir.Value]
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
        if any(r.numel() > MAX_FOLD_NUMEL for r in results if isinstance(r, torch.Tensor)):
            return False
        for out, tensor in zip(outs, results):
            if out.name:
                self.values[out.name] = Val(out.name, const=torch.as_tensor(tensor).detach().cpu())
        return True

    def _kwargs(self, rule: Rule, attrs: dict[str, Any], phys: str) -> dict[str, Any]:
        defaults = rule.defaults()
        kwargs: dict[str, Any] = {}
        for name, value in attrs.items():
            if name in defaults and same_value(defaults[name], value):
                continue
            if isinstance(value, torch.Tensor):  # tensor attributes become CPU buffers
                holder = Val(f"{rule.op_type}_{name}", const=value)
                value = self._const_node(holder, "cpu")
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[name] = value
        return kwargs

    # -- static shapes ------------------------------------------------------------------------

    def _shape(self, value: ir.Value | None) -> tuple[int, ...] | None:
        """The static shape of a blob: from the IR, else from meta propagation."""
        if value is None:
            return None
        shape = static_shape(value)
        if shape is not None:
            return shape
        val = self.values.get(value.name or "")
        if val is not None and val.is_const:
            assert val.const is not None
            return tuple(val.const.shape)
        meta = self.meta.get(value.name or "")
        return tuple(meta.shape) if meta is not None else None

    def _meta_input(self, value: ir.Value | None, val: Val | None, index: int, rule: Rule) -> Any:
        if val is None or value is None:
            return None
        if val.is_const:
            inlined = literal(val, index, rule)
            if inlined is not NOT_LITERAL:
                return inlined
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
        self, rule: Rule, ins: list[Val | None], attrs: dict[str, Any], outs: list[ir.Value]
    ) -> None:
        """Record the outputs' shapes when the IR lacks them, by running the rule on meta tensors."""
        if all(static_shape(out) is not None or not out.name for out in outs):
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

    def shape(self, value: ir.Value | None) -> tuple[int, ...] | None:
        """The static shape of a blob, or None."""
        return self._shape(value)

    def on(self, val: Val, phys: str) -> fx.Node:
        """The fx node of a value on physical device ``phys``."""
        return self._on(val, phys)

    def emit(self, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> fx.Node:
        """Append one fx node."""
        return self._create(op, target, args, kwargs, name)

    def define(self, blob: str, node: fx.Node, device: Device) -> None:
        """Record ``node`` as the value of ``blob`` on logical ``device``."""
        self.values[blob] = Val(blob, node=node, device=device)

    def defer(self, consumer: ir.Node, continuation: Any) -> None:
        """Lower ``consumer`` with ``continuation(lowering, node, inputs, phys)`` instead of its rule."""
        self.deferred[id(consumer)] = continuation

    def constant(self, val: Val | None) -> torch.Tensor | None:
        """The lowering-time value of an input, or None when it is computed at run time."""
        return None if val is None else val.const

    def inline(self, graph: ir.Graph, device: Device, outputs: list[ir.Value]) -> None:
        """Lower ``graph``'s ops in place on logical ``device``; its outputs become ``outputs``."""
        saved, self.device_override = self.device_override, device
        try:
            for initializer in graph.initializers.values():
                tensor = initializer.const_value
                if initializer.name and tensor is not None:
                    self.values[initializer.name] = Val(initializer.name, const=to_torch_tensor(tensor))
            for inner in graph:
                self._lower(inner)
        finally:
            self.device_override = saved
        for out, result in zip(outputs, graph.outputs):
            val = self._value(result, result.producer() or outputs[0].producer())
            if out.name and val is not None:
                self.values[out.name] = val

    def mark_fused(self, blob: str) -> None:
        """``blob`` is computed inside a fused call and never materialized."""
        self.fused.add(blob)
