"""Rules for ops with weights: linears (``MatMul``, ``Gemm``), convolutions, embeddings.

* A linear whose input is whole becomes *column parallel* (each device computes its own
  output columns, in whole heads; :func:`~.weights.column_plan`) where the ``Split`` policy
  allows; one whose input is sharded along the contraction becomes *row parallel*: each
  device multiplies its shard by its rows of the weight, giving a partial sum; a bias
  (``Gemm``'s ``C``, a ``Conv`` bias) is added after the all-reduce.
* A ``Conv`` splits its output channels, then the next one its input channels. A grouped or
  depthwise one splits by whole groups: each device convolves its groups of a channel shard
  (its input's own, or a ``Slice`` of a whole input), its output sharded the same way.
* A ``Gather`` from a vocabulary-sized table becomes *vocab parallel*: each device looks up
  the ids in its rows and zeroes the others (a partial sum).
* Two activations multiplied (attention's ``Q @ K^T`` and ``P @ V``) keep a shard of a batch
  axis (the heads); a shard of the contraction on both sides gives a partial sum.

Each rule returns False where it does not apply; the op is then replicated on whole inputs.

Example:
    >>> sorted(LINEAR_RULES)
    ['Conv', 'Gather', 'Gemm', 'MatMul']
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from placement.errors import InputError
from placement.passes.tensor_parallel.layouts import PARTIAL, REPLICATED, Layout, block_parts
from placement.passes.tensor_parallel.rewriter import Rewriter, attr_value, dims
from placement.passes.tensor_parallel.weights import column_plan, weight_view

__all__ = ["LINEAR_RULES", "Policy", "group_plan"]


class Policy:
    """Which weighted ops may be split (the module scopes the caller named)."""

    def __init__(self, scopes: list[str] | None) -> None:
        self.scopes = scopes

    def allows(self, node: ir.Node) -> bool:
        if self.scopes is None:
            return True
        from placement.graph.nodes import node_scope

        scope = node_scope(node) or ""
        return any(scope == s or scope.startswith(s + ".") for s in self.scopes)


def _disjoint(layout: Layout) -> bool:
    flat = [i for part in layout.parts for i in part]
    return len(flat) == len(set(flat))


def _matmul(rw: Rewriter, node: ir.Node, policy: Policy) -> bool:
    a, b = node.inputs[0], node.inputs[1]
    la, lb = rw.layout(a), rw.layout(b)
    da, db = dims(a), dims(b)
    if da is None or db is None or la.kind == "P" or lb.kind == "P":
        return False
    view = weight_view(b) if len(db) == 2 else None
    ra, rb = len(da), len(db)
    rank = max(ra, rb)
    if view is not None and la.kind == "R":
        n = db[1]
        if not policy.allows(node) or n is None:
            return False
        parts = _columns(node, n, rw.t)
        if parts is None:
            return False
        out = Layout("S", rank - 1, n, parts)
        clones = [
            rw.clone(node, [rw.local(a, d), view.shard(rw, 1, parts[d], d)], d, [out]) for d in range(rw.t)
        ]
        rw.set_outputs(node, [out], clones)
        rw.split.append(node.name or "")
        return True
    if view is not None and la.kind == "S" and la.axis == ra - 1 and _disjoint(la):
        clones = [
            rw.clone(node, [rw.local(a, d), view.shard(rw, 0, la.parts[d], d)], d, [PARTIAL])
            for d in range(rw.t)
        ]
        rw.set_outputs(node, [PARTIAL], clones)
        rw.split.append(node.name or "")
        return True
    return _batched(rw, node, la, lb, ra, rb, rank)


def _batched(rw: Rewriter, node: ir.Node, la: Layout, lb: Layout, ra: int, rb: int, rank: int) -> bool:
    """Activation @ activation (or a sharded batch axis times a whole weight)."""
    a, b = node.inputs[0], node.inputs[1]
    if (
        la.kind == "S"
        and lb.kind == "S"
        and la.axis == ra - 1
        and lb.axis == rb - 2
        and la.parts == lb.parts
        and _disjoint(la)
    ):
        clones = [rw.clone(node, [rw.local(a, d), rw.local(b, d)], d, [PARTIAL]) for d in range(rw.t)]
        rw.set_outputs(node, [PARTIAL], clones)
        return True
    # a sharded batch axis (in output coordinates) shared by both sides
    candidates = []
    if la.kind == "S" and la.axis < ra - 2 and ra >= 3:
        candidates.append(Layout("S", la.axis + rank - ra, la.size, la.parts))
    if lb.kind == "S" and lb.axis < rb - 2 and rb >= 3:
        candidates.append(Layout("S", lb.axis + rank - rb, lb.size, lb.parts))
    if candidates:
        widest = max(c.size for c in candidates)  # an axis of 1 broadcasts against the other side
        candidates = [c for c in candidates if c.size == widest]
        out = min(candidates, key=lambda lay: sum(len(p) for p in lay.parts))
        if any(c.axis != out.axis for c in candidates):
            return False
        ins = [_batch_operand(rw, v, out, rank, d) for d in range(rw.t) for v in (a, b)]
        clones = [rw.clone(node, ins[2 * d : 2 * d + 2], d, [out]) for d in range(rw.t)]
        rw.set_outputs(node, [out], clones)
        return True
    if la.kind == "S" and la.axis == ra - 2 and lb.kind == "R":
        out = Layout("S", rank - 2, la.size, la.parts)
    elif lb.kind == "S" and lb.axis == rb - 1 and la.kind == "R":
        out = Layout("S", rank - 1, lb.size, lb.parts)
    else:
        return False
    clones = [rw.clone(node, [rw.local(a, d), rw.local(b, d)], d, [out]) for d in range(rw.t)]
    rw.set_outputs(node, [out], clones)
    return True


def _batch_operand(rw: Rewriter, value: ir.Value, out: Layout, rank: int, d: int) -> ir.Value:
    shape = dims(value)
    axis = out.axis - (rank - len(shape))
    have = rw.layout(value)
    if axis >= 0 and shape[axis] == 1 and out.size > 1:  # broadcast against the other side's heads
        if have.kind == "S" and have.axis == axis and all(p == (0,) for p in have.parts):
            return rw.local(value, d)  # one head on every device: already whole
        return rw.replicated(value, d)
    if axis < 0 or (shape[axis] == 1 and not (have.kind == "S" and have.axis == axis)):
        return rw.replicated(value, d)  # broadcast along the shard (a one-head shard is no broadcast)
    return rw.as_shard(value, Layout("S", axis, out.size, out.parts), d)


def _columns(node: ir.Node, n: int, degree: int) -> tuple[tuple[int, ...], ...] | None:
    """The column plan of a column-parallel op, or None where it has fewer columns than devices
    (it stays whole)."""
    try:
        parts = column_plan(node.outputs[0], n, degree)
    except InputError as error:
        raise InputError(f"op {node.name!r} ({node.op_type}): {error}") from None
    if any(not p for p in parts) or (
        n < degree and all(len(p) == 1 for p in parts) and len(set(parts)) < degree
    ):
        return None
    return parts


def _gemm(rw: Rewriter, node: ir.Node, policy: Policy) -> bool:
    a, b = node.inputs[0], node.inputs[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    if attr_value(node, "transA", 0) or a is None:
        return False
    view = weight_view(b)
    la = rw.layout(a)
    if view is None or la.kind == "P" or (c is not None and c.const_value is None):
        return False
    trans_b = bool(attr_value(node, "transB", 0))
    n_axis, k_axis = (0, 1) if trans_b else (1, 0)
    n = dims(b)[n_axis]
    if la.kind == "R":
        parts = _columns(node, n, rw.t) if policy.allows(node) else None
        if parts is None:
            return False
        out = Layout("S", 1, n, parts)
        clones = []
        for d in range(rw.t):
            bias = None
            if c is not None:
                cd = dims(c)
                bias = c if cd[-1] == 1 else rw.as_shard(c, Layout("S", len(cd) - 1, n, parts), d)
            clones.append(
                rw.clone(node, [rw.local(a, d), view.shard(rw, n_axis, parts[d], d), bias], d, [out])
            )
        rw.set_outputs(node, [out], clones)
        rw.split.append(node.name or "")
        return True
    if la.kind == "S" and la.axis == 1 and _disjoint(la):
        attrs = {k: v for k, v in node.attributes.items() if k != "beta"}
        partials = [
            rw.clone(
                node, [rw.local(a, d), view.shard(rw, k_axis, la.parts[d], d)], d, [PARTIAL], attributes=attrs
            ).outputs[0]
            for d in range(rw.t)
        ]
        _bias_after(rw, node, partials, c, float(attr_value(node, "beta", 1.0)), None)
        rw.split.append(node.name or "")
        return True
    return False


def _bias_after(
    rw: Rewriter,
    node: ir.Node,
    partials: list[ir.Value],
    bias: ir.Value | None,
    beta: float,
    shape: list[int] | None,
) -> None:
    """All-reduce ``partials`` and add ``bias`` (scaled, reshaped) on each device: ``node``'s
    output, whole."""
    out = node.outputs[0]
    whole = rw.reduce_partials(partials, out)
    if bias is None:
        rw.define(out, REPLICATED, whole)
        return
    data = bias.const_value.numpy()
    if beta != 1.0 or shape is not None:
        data = (data * np.asarray(beta, dtype=data.dtype)).reshape(shape if shape is not None else data.shape)
        bias = rw.constant(np.ascontiguousarray(data), f"{bias.name}.after_reduce")
    adds = []
    for d in range(rw.t):
        add = rw.emit("Add", [whole[d], bias], d, hint=f"{out.name}.tp{d}", meta=dict(node.metadata_props))
        add.outputs[0].type, add.outputs[0].shape = out.type, out.shape
        adds.append(add.outputs[0])
    rw.define(out, REPLICATED, adds)


def _conv(rw: Rewriter, node: ir.Node, policy: Policy) -> bool:
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    lx = rw.layout(x)
    if weight_view(w) is None or w.producer() is not None or lx.kind == "P":
        return False
    if attr_value(node, "group", 1) != 1:
        return _grouped_conv(rw, node, lx, bias) or (policy.allows(node) and _groups_of_whole(rw, node, bias))
    shape = dims(w)
    if lx.kind == "R":
        if not policy.allows(node):
            return False
        parts = _columns_conv(shape[0], rw.t)
        if parts is None:
            return False
        out = Layout("S", 1, shape[0], parts)
        clones = [
            rw.clone(
                node,
                [
                    rw.local(x, d),
                    rw.param_shard(w, 0, parts[d], d),
                    None if bias is None else rw.param_shard(bias, 0, parts[d], d),
                ],
                d,
                [out],
            )
            for d in range(rw.t)
        ]
        rw.set_outputs(node, [out], clones)
        rw.split.append(node.name or "")
        return True
    if lx.kind == "S" and lx.axis == 1 and _disjoint(lx):
        partials = [
            rw.clone(node, [rw.local(x, d), rw.param_shard(w, 1, lx.parts[d], d)], d, [PARTIAL]).outputs[0]
            for d in range(rw.t)
        ]
        _bias_after(
            rw, node, partials, bias, 1.0, [-1] + [1] * (len(shape) - 2) if bias is not None else None
        )
        rw.split.append(node.name or "")
        return True
    return False


def _grouped_conv(rw: Rewriter, node: ir.Node, lx: Layout, bias: ir.Value | None) -> bool:
    """A grouped (or depthwise) convolution whose input is split on its channels along whole
    groups: each device convolves its own groups, its output split the same way."""
    x, w = node.inputs[0], node.inputs[1]
    groups, shape = attr_value(node, "group", 1), dims(w)
    if lx.kind != "S" or lx.axis != 1 or not _disjoint(lx) or not shape or lx.size % groups:
        return False
    per_in, per_out = lx.size // groups, shape[0] // groups
    owned = []
    for part in lx.parts:
        mine = sorted({c // per_in for c in part})
        if list(part) != [g * per_in + j for g in mine for j in range(per_in)]:
            return False  # a part cuts a group, or holds channels out of group order
        owned.append(mine)
    if any(not mine for mine in owned):
        return False
    rows = tuple(tuple(g * per_out + j for g in mine for j in range(per_out)) for mine in owned)
    out = Layout("S", 1, shape[0], rows)
    clones = []
    for d in range(rw.t):
        inputs = [
            rw.local(x, d),
            rw.param_shard(w, 0, rows[d], d),
            None if bias is None else rw.param_shard(bias, 0, rows[d], d),
        ]
        attrs = {**node.attributes, "group": ir.AttrInt64("group", len(owned[d]))}
        clones.append(rw.clone(node, inputs, d, [out], attributes=attrs))
    rw.set_outputs(node, [out], clones)
    rw.split.append(node.name or "")
    return True


def _groups_of_whole(rw: Rewriter, node: ir.Node, bias: ir.Value | None) -> bool:
    """A grouped (or depthwise) convolution whose input is whole (or sharded across its
    groups): each device takes a channel ``Slice`` of its input along its own groups and
    convolves them; the output keeps the channel shard. Groups spread as evenly as they go
    (the first devices take one group more); with fewer groups than devices, each group's
    output channels split over the devices it has (the first groups take one device more)."""
    x, w = node.inputs[0], node.inputs[1]
    groups, shape = attr_value(node, "group", 1), dims(w)
    if not shape or shape[0] is None or shape[1] is None or shape[0] % groups:
        return False
    plan = group_plan(groups, shape[0] // groups, rw.t)
    if plan is None:
        return False  # fewer output channels in a group than devices on it: it runs whole
    per_in = shape[1]
    ins = Layout(
        "S",
        1,
        per_in * groups,
        tuple(tuple(g * per_in + j for g in mine for j in range(per_in)) for mine, _ in plan),
    )
    out = Layout("S", 1, shape[0], tuple(rows for _, rows in plan))
    clones = []
    for d, (mine, rows) in enumerate(plan):
        inputs = [
            rw.as_shard(x, ins, d),  # a local Slice of a whole input
            rw.param_shard(w, 0, rows, d),
            None if bias is None else rw.param_shard(bias, 0, rows, d),
        ]
        attrs = {**node.attributes, "group": ir.AttrInt64("group", len(mine))}
        clones.append(rw.clone(node, inputs, d, [out], attributes=attrs))
    rw.set_outputs(node, [out], clones)
    rw.split.append(node.name or "")
    return True


def group_plan(
    groups: int, per_out: int, degree: int
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None:
    """Per device, (its groups, its output channels) of a grouped convolution with ``groups``
    groups of ``per_out`` output channels each over ``degree`` devices, or None where a group
    has fewer output channels than devices.

    Example:
        >>> group_plan(5, 1, 2)  # ragged: 3 groups and 2
        (((0, 1, 2), (0, 1, 2)), ((3, 4), (3, 4)))
        >>> group_plan(2, 4, 3)  # group 0 on devices 0 and 1, group 1 on device 2
        (((0,), (0, 1)), ((0,), (2, 3)), ((1,), (4, 5, 6, 7)))
    """
    if groups >= degree:
        return tuple(
            (mine, tuple(g * per_out + j for g in mine for j in range(per_out)))
            for mine in block_parts(groups, degree)
        )
    plan = []
    for g, devices in enumerate(block_parts(degree, groups)):
        if per_out < len(devices):
            return None
        for rows in block_parts(per_out, len(devices)):
            plan.append(((g,), tuple(g * per_out + j for j in rows)))
    return tuple(plan)


def _columns_conv(channels: int, degree: int) -> tuple[tuple[int, ...], ...] | None:
    return block_parts(channels, degree) if channels >= degree else None


def _gather(rw: Rewriter, node: ir.Node, policy: Policy) -> bool:
    """A vocab-parallel embedding lookup."""
    table, ids = node.inputs[0], node.inputs[1]
    shape = dims(table)
    if (
        table is None
        or not table.is_initializer()
        or table.const_value is None
        or len(shape) != 2
        or attr_value(node, "axis", 0) != 0
        or rw.layout(ids).kind != "R"
        or not policy.allows(node)
    ):
        return False
    rows, cols = shape
    if rows < cols or rows < rw.t:
        return False
    parts = block_parts(rows, rw.t)
    out = node.outputs[0]
    partials = []
    for d, part in enumerate(parts):
        local_ids = rw.local(ids, d)
        hint = f"{out.name}.tp{d}"
        start = rw.constant(np.array(part[0], dtype=_np_dtype(ids)), f"{hint}.first")
        stop = rw.constant(np.array(part[-1] + 1, dtype=_np_dtype(ids)), f"{hint}.stop")
        zero_id = rw.constant(np.array(0, dtype=_np_dtype(ids)), f"{hint}.zero_id")
        low = rw.emit("GreaterOrEqual", [local_ids, start], d, hint=f"{hint}.low").outputs[0]
        high = rw.emit("Less", [local_ids, stop], d, hint=f"{hint}.high").outputs[0]
        mine = rw.emit("And", [low, high], d, hint=f"{hint}.mine").outputs[0]
        shifted = rw.emit("Sub", [local_ids, start], d, hint=f"{hint}.shifted").outputs[0]
        safe = rw.emit("Where", [mine, shifted, zero_id], d, hint=f"{hint}.ids").outputs[0]
        rows_d = rw.emit(
            "Gather",
            [rw.param_shard(table, 0, part, d), safe],
            d,
            hint=f"{hint}.rows",
            attributes=[ir.AttrInt64("axis", 0)],
            meta=dict(node.metadata_props),
        ).outputs[0]
        axes = rw.constant(np.array([-1], np.int64), f"{hint}.axes")
        keep = rw.emit("Unsqueeze", [mine, axes], d, hint=f"{hint}.keep").outputs[0]
        zero = rw.constant(np.zeros((), dtype=table.const_value.numpy().dtype), f"{hint}.zero")
        masked = rw.emit(
            "Where",
            [keep, rows_d, zero],
            d,
            hint=f"{hint}.partial",
            role="partial",
            meta=dict(node.metadata_props),
        ).outputs[0]
        masked.type, masked.shape = out.type, out.shape
        _typed(ids, out, low, high, mine, shifted, safe, rows_d, keep)
        partials.append(masked)
    rw.define(out, PARTIAL, partials)
    rw.split.append(node.name or "")
    return True


def _typed(ids: ir.Value, out: ir.Value, *values: ir.Value) -> None:
    """Types and shapes of a vocab-parallel lookup's intermediate values."""
    low, high, mine, shifted, safe, rows, keep = values
    flags = ir.TensorType(ir.DataType.BOOL)
    for value, kind, shape in (
        (low, flags, ids.shape),
        (high, flags, ids.shape),
        (mine, flags, ids.shape),
        (shifted, ids.type, ids.shape),
        (safe, ids.type, ids.shape),
        (rows, out.type, out.shape),
        (keep, flags, None if ids.shape is None else ir.Shape([*ids.shape, 1])),
    ):
        value.type, value.shape = kind, shape


def _np_dtype(value: ir.Value) -> np.dtype:
    if value.dtype is None:
        raise InputError(f"blob {value.name!r}: the ids of an embedding lookup have no known type")
    return np.dtype(value.dtype.numpy())


#: op type -> rule(rewriter, node, policy) -> handled
LINEAR_RULES: dict[str, Callable[[Rewriter, ir.Node, Policy], bool]] = {
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Conv": _conv,
    "Gather": _gather,
}
