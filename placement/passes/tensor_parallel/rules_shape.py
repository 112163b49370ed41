"""Rules that move a shard through element-wise ops, normalisations, reductions and shape ops.

A shard of axis ``a`` passes an op when the op treats the slices along ``a`` independently:
element-wise ops (a whole operand with that axis is sliced to match; one that broadcasts along it
is read whole), softmax, normalisation and reductions over other axes, pooling over spatial
axes, transposes (the axis moves), reshapes that keep the axis, split it into whole heads or
merge inner axes into it (the shape constant is rewritten per device), ``Split`` along it (the
section sizes become each device's own), ``Unsqueeze``/``Squeeze``/``Expand``/``Slice``/``Concat``
elsewhere.

Example:
    >>> "Reshape" in SHAPE_RULES and "Softmax" in SHAPE_RULES
    True
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from placement.errors import InputError
from placement.passes.tensor_parallel.layouts import Layout, expand_parts
from placement.passes.tensor_parallel.rewriter import Rewriter, attr_value, dims, static_int
from placement.passes.tensor_parallel.weights import BROADCAST, UNARY

__all__ = ["SHAPE_RULES"]


def _first_shard(rw: Rewriter, node: ir.Node) -> Layout | None:
    """The shard (in output coordinates) an element-wise op keeps: the input shard with the
    fewest elements per device (its lists are subsets of the others', e.g. query heads of
    replicated KV heads)."""
    out_rank = len(dims(node.outputs[0]) or [])
    found = []
    for v in node.inputs:
        lay = rw.layout(v)
        if v is not None and lay.kind == "S":
            shape = dims(v)
            if shape is None:
                return None
            found.append(Layout("S", lay.axis + out_rank - len(shape), lay.size, lay.parts))
    if not found:
        return None
    found = [lay for lay in found if lay.size > 1] or found  # a one-head shard broadcasts
    return min(found, key=lambda lay: sum(len(p) for p in lay.parts))


def _operand(rw: Rewriter, value: ir.Value | None, out: Layout, out_rank: int, d: int) -> ir.Value | None:
    if value is None:
        return None
    shape = dims(value)
    axis = out.axis - (out_rank - len(shape))
    have = rw.layout(value)
    if axis >= 0 and shape[axis] == 1 and out.size > 1:  # broadcast against the other side's heads
        if have.kind == "S" and have.axis == axis and all(p == (0,) for p in have.parts):
            return rw.local(value, d)  # one head on every device: already whole
        return rw.replicated(value, d)
    if axis < 0 or (shape[axis] == 1 and not (have.kind == "S" and have.axis == axis)):
        return rw.replicated(value, d)  # broadcast along the shard (a one-head shard is no broadcast)
    return rw.as_shard(value, Layout("S", axis, out.size, out.parts), d)


def _elementwise(rw: Rewriter, node: ir.Node) -> bool:
    if len(node.outputs) != 1 and node.op_type != "Dropout":
        return False
    out_shape = dims(node.outputs[0])
    if out_shape is None or any(rw.layout(v).kind == "P" for v in node.inputs if v is not None):
        return False
    if any(v is not None and dims(v) is None for v in node.inputs):
        return False
    out = _first_shard(rw, node)
    if out is None:
        return False
    rank = len(out_shape)
    lays = [out] + [Layout("R")] * (len(node.outputs) - 1)
    if node.op_type == "Dropout":
        lays = [out] * len(node.outputs)
    clones = [
        rw.clone(node, [_operand(rw, v, out, rank, d) for v in node.inputs], d, lays) for d in range(rw.t)
    ]
    rw.set_outputs(node, lays, clones)
    return True


def _keep(
    rw: Rewriter, node: ir.Node, axis_out: int | None, extra: Callable[[int], list] | None = None
) -> bool:
    """Clone ``node`` on its first input's shard, other inputs whole (or ``extra(d)``), the
    output sharded along ``axis_out``."""
    if axis_out is None:
        return False
    lay = rw.layout(node.inputs[0])
    out = Layout("S", axis_out, lay.size, lay.parts)
    clones = []
    for d in range(rw.t):
        rest = extra(d) if extra is not None else [rw.replicated(v, d) for v in node.inputs[1:]]
        clones.append(rw.clone(node, [rw.local(node.inputs[0], d), *rest], d, [out] * len(node.outputs)))
    rw.set_outputs(node, [out] * len(node.outputs), clones)
    return True


def _sharded_input(rw: Rewriter, node: ir.Node) -> tuple[Layout, int] | None:
    x = node.inputs[0] if node.inputs else None
    lay = rw.layout(x)
    shape = dims(x) if x is not None else None
    if (
        lay.kind != "S"
        or shape is None
        or any(rw.layout(v).kind != "R" for v in node.inputs[1:] if v is not None)
    ):
        return None
    return lay, len(shape)


def _axis_free(rw: Rewriter, node: ir.Node, axes: Callable[[ir.Node, int], list[int] | None]) -> bool:
    """Softmax, normalisation, reductions, pooling: the shard passes if the op works on other axes."""
    found = _sharded_input(rw, node)
    if found is None:
        return False
    lay, rank = found
    used = axes(node, rank)
    if used is None or lay.axis in used:
        return False
    if node.op_type.startswith("Reduce") and not attr_value(node, "keepdims", 1):
        return _keep(rw, node, lay.axis - sum(1 for a in used if a < lay.axis))
    if node.op_type in ("BatchNormalization", "InstanceNormalization"):
        if len(node.outputs) != 1:
            return False
        return _keep(
            rw,
            node,
            lay.axis,
            lambda d: [rw.as_shard(v, Layout("S", 0, lay.size, lay.parts), d) for v in node.inputs[1:]],
        )
    if node.op_type == "LayerNormalization" and len(node.outputs) != 1:
        return False
    return _keep(rw, node, lay.axis)


def _softmax_axes(node: ir.Node, rank: int) -> list[int]:
    return [attr_value(node, "axis", -1) % rank]


def _norm_axes(node: ir.Node, rank: int) -> list[int]:
    return list(range(attr_value(node, "axis", -1) % rank, rank))


def _spatial_axes(node: ir.Node, rank: int) -> list[int]:
    """Normalisation and pooling treat channels (axis 1) apart; normalisation mixes the
    batch too."""
    if node.op_type in ("BatchNormalization", "InstanceNormalization"):
        return [i for i in range(rank) if i != 1]
    return list(range(2, rank))


def _reduce_axes(node: ir.Node, rank: int) -> list[int] | None:
    axes = static_int(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if axes is None:
        axes = attr_value(node, "axes", None)
    if axes is None or len(axes) == 0:
        return None
    return [int(a) % rank for a in axes]


def _transpose(rw: Rewriter, node: ir.Node) -> bool:
    found = _sharded_input(rw, node)
    if found is None:
        return False
    lay, rank = found
    perm = list(attr_value(node, "perm", list(range(rank))[::-1]))
    return _keep(rw, node, perm.index(lay.axis))


def _unsqueeze(rw: Rewriter, node: ir.Node) -> bool:
    found = _sharded_input(rw, node)
    if found is None:
        return False
    lay, rank = found
    axes = static_int(node.inputs[1]) if len(node.inputs) > 1 else attr_value(node, "axes", None)
    if axes is None:
        return False
    out_rank = rank + len(axes)
    inserted = sorted(int(a) % out_rank for a in axes)
    kept = [i for i in range(out_rank) if i not in inserted]
    return _keep(rw, node, kept[lay.axis])


def _squeeze(rw: Rewriter, node: ir.Node) -> bool:
    found = _sharded_input(rw, node)
    if found is None:
        return False
    lay, rank = found
    axes = (
        static_int(node.inputs[1])
        if len(node.inputs) > 1 and node.inputs[1] is not None
        else attr_value(node, "axes", None)
    )
    if axes is None:
        return False
    axes = [int(a) % rank for a in axes]
    if lay.axis in axes:
        return False
    return _keep(rw, node, lay.axis - sum(1 for a in axes if a < lay.axis))


def _slice(rw: Rewriter, node: ir.Node) -> bool:
    found = _sharded_input(rw, node)
    if found is None:
        return False
    lay, rank = found
    axes = static_int(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    if axes is None:
        starts = static_int(node.inputs[1])
        if starts is None:
            return False
        axes = list(range(len(starts)))
    if lay.axis in [int(a) % rank for a in axes]:
        return False
    return _keep(rw, node, lay.axis)


def _concat(rw: Rewriter, node: ir.Node) -> bool:
    out_shape = dims(node.outputs[0])
    out = _first_shard(rw, node)
    if out is None or out_shape is None or attr_value(node, "axis", 0) % len(out_shape) == out.axis:
        return False
    if any(rw.layout(v).kind == "P" or dims(v) is None for v in node.inputs):
        return False
    clones = [rw.clone(node, [rw.as_shard(v, out, d) for v in node.inputs], d, [out]) for d in range(rw.t)]
    rw.set_outputs(node, [out], clones)
    return True


def _split(rw: Rewriter, node: ir.Node) -> bool:
    found = _sharded_input(rw, node)
    if found is None:
        return False
    lay, rank = found
    axis = attr_value(node, "axis", 0) % rank
    if axis != lay.axis:
        return _keep(rw, node, lay.axis)
    from placement.passes.tensor_parallel.weights import _split_sizes

    sizes = _split_sizes(node, lay.size)
    if sizes is None or sum(sizes) != lay.size:
        return False
    outs, start = [], 0
    for n in sizes:
        outs.append(
            Layout(
                "S", axis, n, tuple(tuple(i - start for i in p if start <= i < start + n) for p in lay.parts)
            )
        )
        start += n
    if any(not p for o in outs for p in o.parts):
        raise InputError(f"op {node.name!r} (Split): a device would hold nothing of one of its sections")
    attrs = {k: v for k, v in node.attributes.items() if k != "num_outputs"}
    clones = []
    for d in range(rw.t):
        counts = rw.constant(np.array([len(o.parts[d]) for o in outs], np.int64), f"{node.name}.tp{d}.split")
        clones.append(rw.clone(node, [rw.local(node.inputs[0], d), counts], d, outs, attributes=attrs))
    rw.set_outputs(node, outs, clones)
    return True


def _reshape(rw: Rewriter, node: ir.Node) -> bool:
    found = _sharded_input(rw, node)
    if found is None:
        return False
    lay, _ = found
    ins, outs = _named_dims(node.inputs[0]), _named_dims(node.outputs[0])
    if outs is None:
        return False
    mapped = _map_axis(ins, outs, lay)
    if mapped is None:
        return _merged_transpose(rw, node, lay)
    axis, out = mapped
    counts = [len(p) for p in out.parts]
    return _keep(
        rw, node, axis, lambda d: [_shape_with(rw, node, node.inputs[1], axis, counts, d)]
    ) and _relabel(rw, node, out)


def _merged_transpose(rw: Rewriter, node: ir.Node, lay: Layout) -> bool:
    """``Reshape`` (b, heads, t, d) -> (b * heads, t, d), a ``Transpose`` keeping the first
    axis, a ``Reshape`` back to (b, heads, ...): the exporter's transpose of a 4-D key. The
    merged axis cannot hold a shard of its heads, so with the head axis sharded each device
    transposes its own heads (one ``Transpose`` of the 4-D shard) and the chain's last
    ``Reshape`` keeps the shard; the two ops after this one are done with it."""
    x, merged = node.inputs[0], node.outputs[0]
    ins, outs = _named_dims(x), _named_dims(merged)
    if ins is None or outs is None or len(ins) != 4 or len(outs) != 3 or lay.axis != 1:
        return False
    if [_extent([v]) for v in ins[2:]] != [_extent([v]) for v in outs[1:]] or merged.is_graph_output():
        return False
    users = list(merged.uses())
    if len(users) != 1 or users[0].node.op_type != "Transpose" or users[0].node.domain != "":
        return False
    transpose = users[0].node
    perm = list(attr_value(transpose, "perm", [2, 1, 0]))
    turned = transpose.outputs[0]
    after = list(turned.uses())
    if perm[0] != 0 or turned.is_graph_output() or len(after) != 1 or after[0].node.op_type != "Reshape":
        return False
    back = after[0].node
    want = [ins[0], ins[1], *(ins[p + 1] for p in perm[1:])]
    got = _named_dims(back.outputs[0])
    if got is None or [_extent([v]) for v in got] != [_extent([v]) for v in want]:
        return False
    full = [0, 1, *(p + 1 for p in perm[1:])]
    out = back.outputs[0]
    shard = Layout("S", 1, lay.size, lay.parts)
    locals_ = []
    for d in range(rw.t):
        made = rw.emit(
            "Transpose",
            [rw.local(x, d)],
            d,
            hint=f"{out.name}.tp{d}",
            attributes=[ir.AttrInt64s("perm", full)],
            meta=dict(back.metadata_props),
            role="shard",
        ).outputs[0]
        made.type = out.type
        if out.shape is not None:
            shape = list(out.shape)
            shape[1] = len(lay.parts[d])
            made.shape = ir.Shape(shape)
        locals_.append(made)
    rw.define(out, shard, locals_)
    rw.done.update((transpose, back))
    return True


def _relabel(rw: Rewriter, node: ir.Node, out: Layout) -> bool:
    rw.layouts[node.outputs[0]] = out
    for d, value in enumerate(rw.locals[node.outputs[0]]):
        if node.outputs[0].shape is not None:
            shape = list(node.outputs[0].shape)
            shape[out.axis] = len(out.parts[d])
            value.shape = ir.Shape(shape)
    return True


def _named_dims(value: ir.Value) -> list[int | str | None] | None:
    """The value's dims: an int, a symbolic dim's name (``"batch"``), or None for an unnamed
    one; None when its rank is unknown."""
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else getattr(d, "value", None) for d in value.shape]


#: A symbolic dim the exporter names as a product of symbols (``s10*s70``: batch times
#: sequence, a flattened ``view(-1, hidden)``).
_PRODUCT = re.compile(r"^[A-Za-z_]\w*(\*[A-Za-z_]\w*)+$")


def _extent(values: list[int | str | None]) -> tuple[int, tuple[str, ...]] | None:
    """The number of elements spanned by ``values`` as (product of the static dims, the
    symbolic names, sorted): equal extents span the same number for every size the symbols
    take. None when a dim is unnamed (no extent can be compared)."""
    total, names = 1, []
    for v in values:
        if isinstance(v, int):
            total *= v
        elif isinstance(v, str):
            names += v.split("*") if _PRODUCT.match(v) else [v]
        else:
            return None
    return total, tuple(sorted(names))


def _map_axis(
    ins: list[int | str | None] | None, outs: list[int | str | None], lay: Layout
) -> tuple[int, Layout] | None:
    """Where the shard of a reshape's input lands: the same axis, whole heads of a split one,
    or a merge with the axes after it. The axes before the shard must span the same extent in
    and out (a dynamic batch matches by its symbol's name)."""
    if ins is None:
        return None
    prefix = _extent(ins[: lay.axis])
    if prefix is None:
        return None
    for b in range(len(outs) + 1):
        if _extent(outs[:b]) == prefix and b < len(outs):
            n, m = lay.size, outs[b]
            if not isinstance(m, int):
                return None
            if m == n:
                return b, lay.moved(b)
            if m < n and n % m == 0 and _product(outs[b : b + 1]) and _tail_is(outs, b, n):
                block = n // m
                heads = []
                for part in lay.parts:
                    hs = sorted({i // block for i in part})
                    if sorted(part) != [h * block + j for h in hs for j in range(block)]:
                        return None
                    heads.append(tuple(hs))
                return b, Layout("S", b, m, tuple(heads))
            if m > n and m % n == 0 and _merges(ins, lay.axis, m // n):
                return b, Layout("S", b, m, expand_parts(lay.parts, m // n))
            return None
    return None


def _tail_is(outs: list[int | str | None], b: int, n: int) -> bool:
    total = 1
    for v in outs[b:]:
        if not isinstance(v, int):
            return False
        total *= v
        if total == n:
            return True
    return False


def _merges(ins: list[int | str | None], axis: int, inner: int) -> bool:
    total = 1
    for v in ins[axis + 1 :]:
        if not isinstance(v, int):
            return False
        total *= v
        if total == inner:
            return True
    return inner == 1


def _product(values: list[int | None]) -> int | None:
    total = 1
    for v in values:
        if not isinstance(v, int):
            return None
        total *= v
    return total


def _shape_with(
    rw: Rewriter, node: ir.Node, shape: ir.Value, pos: int, counts: list[int], d: int
) -> ir.Value:
    """Device ``d``'s shape input: ``shape`` with entry ``pos`` set to ``counts[d]`` (kept where
    it is ``-1``), from a constant or from a ``Concat`` with a constant piece there."""
    data = static_int(shape)
    if data is not None:
        if int(data[pos]) == -1:
            return shape
        if int(data[pos]) == 0 and not attr_value(node, "allowzero", 0):
            raise InputError(f"op {node.name!r} ({node.op_type}): a 0 (copy) entry on the split axis")
        new = np.array(data, copy=True)
        new[pos] = counts[d]
        return rw.constant(new, f"{shape.name}.tp{d}")
    producer = shape.producer()
    if producer is not None and producer.op_type == "Concat":
        pieces, start = [], 0
        for piece in producer.inputs:
            length = (dims(piece) or [None])[0]
            if length is None:
                break
            if start <= pos < start + length:
                pieces.append(_shape_with(rw, node, piece, pos - start, counts, d))
            else:
                pieces.append(rw.replicated(piece, d))
            start += length
        else:
            cat = rw.emit(
                "Concat", pieces, d, hint=f"{shape.name}.tp{d}", attributes=[ir.AttrInt64("axis", 0)]
            )
            cat.outputs[0].type, cat.outputs[0].shape = shape.type, shape.shape
            return cat.outputs[0]
    raise InputError(
        f"op {node.name!r} ({node.op_type}): its shape {shape.name!r} is computed; "
        "the split axis needs a constant entry"
    )


def _expand(rw: Rewriter, node: ir.Node) -> bool:
    found = _sharded_input(rw, node)
    if found is None:
        return False
    lay, rank = found
    outs = dims(node.outputs[0])
    if outs is None:
        return False
    axis = lay.axis + len(outs) - rank
    counts = [len(p) for p in lay.parts]
    shape = node.inputs[1]
    data = static_int(shape)
    if data is not None and int(data[axis]) == 1:
        return _keep(rw, node, axis)
    return _keep(rw, node, axis, lambda d: [_shape_with(rw, node, shape, axis, counts, d)])


def _unary(rw: Rewriter, node: ir.Node) -> bool:
    return _elementwise(rw, node)


#: op type -> rule(rewriter, node) -> handled
SHAPE_RULES: dict[str, Callable[[Rewriter, ir.Node], bool]] = {
    **dict.fromkeys(UNARY, _unary),
    **dict.fromkeys(BROADCAST, _elementwise),
    "Softmax": lambda rw, n: _axis_free(rw, n, _softmax_axes),
    "LogSoftmax": lambda rw, n: _axis_free(rw, n, _softmax_axes),
    "LayerNormalization": lambda rw, n: _axis_free(rw, n, _norm_axes),
    "BatchNormalization": lambda rw, n: _axis_free(rw, n, _spatial_axes),
    "InstanceNormalization": lambda rw, n: _axis_free(rw, n, _spatial_axes),
    **{
        op: (lambda rw, n: _axis_free(rw, n, _spatial_axes))
        for op in ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool")
    },
    **{
        op: (lambda rw, n: _axis_free(rw, n, _reduce_axes))
        for op in (
            "ReduceMean",
            "ReduceSum",
            "ReduceMax",
            "ReduceMin",
            "ReduceProd",
            "ReduceL2",
            "ReduceSumSquare",
        )
    },
    "Transpose": _transpose,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Slice": _slice,
    "Concat": _concat,
    "Split": _split,
    "Reshape": _reshape,
    "Expand": _expand,
}
