"""Attention ops split by heads: ONNX ``Attention`` (opset 23) and ONNX Runtime's
``com.microsoft`` ``MultiHeadAttention`` and ``GroupQueryAttention``.

Each device runs the op on its own heads (:func:`~.heads.head_plan`): its query, key and
value are its heads' columns of the hidden axis (``(batch, sequence, heads * head_size)``,
or the head axis of ``(batch, heads, sequence, head_size)`` inputs; a packed QKV input of
``GroupQueryAttention`` holds its query, key and value heads' columns of each section), its
past key and value their KV heads along the head axis (``(batch, kv_heads, past,
head_size)``), its ``num_heads`` / ``kv_num_heads`` (``q_num_heads`` / ``kv_num_heads``)
attributes its own counts. A per-head input (an attention bias or mask with a head axis, a
``head_sink``, ``MultiHeadAttention``'s packed projection bias) is sliced to the device's
heads; everything else (masks without a head axis, ``seqlens_k``, rotary cos/sin caches,
positions) is read whole. Every head is computed exactly as the unsplit op computes it, so
the outputs are the unsplit ones: the attention output is sharded along its hidden (or
head) axis, the present key and value along their head axis (a KV cache split on its
heads; a graph output gathers it whole). The query's columns are the ones the column
parallel linear before it computes, so the row parallel linear after it needs no
collective before it.

``RotaryEmbedding`` (ONNX or ``com.microsoft``) between a projection and the attention keeps
the shard of whole heads (each device its ``num_heads``), the cos/sin caches read whole.

Refused with a named :class:`~placement.errors.InputError`: head counts the degree cannot
spread, quantized KV caches, packed ``MultiHeadAttention`` QKV / KV inputs.

Example:
    >>> sorted(HEAD_OPS)
    [('', 'Attention'), ('com.microsoft', 'GroupQueryAttention'), ('com.microsoft', 'MultiHeadAttention')]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from placement.errors import InputError
from placement.passes.tensor_parallel.heads import head_plan
from placement.passes.tensor_parallel.layouts import Layout, Parts, expand_parts
from placement.passes.tensor_parallel.rewriter import Rewriter, attr_value, dims

__all__ = ["ATTENTION_RULES", "HEAD_OPS", "PER_HEAD_OPS", "attention_sections"]

MS = "com.microsoft"

# Input roles: "q", "k", "v" (the hidden or head axis, by query or KV heads), "qkv" (packed),
# "cache" (head axis 1 by KV heads), "qcache" (head axis 1 by query heads), "bias4" (a
# bias or mask broadcast to (batch, heads, S, T): its third axis from last by query heads
# where it has one), "sink" (axis 0 by query heads),
# "mha_bias" (MultiHeadAttention's q, k, v projection bias), "refuse" (not split).
_INPUTS = {
    (MS, "GroupQueryAttention"): {
        0: "q", 1: "k", 2: "v", 3: "cache", 4: "cache", 10: "bias4", 11: "sink", 12: "refuse", 13: "refuse",
    },
    (MS, "MultiHeadAttention"): {
        0: "q", 1: "k", 2: "v", 3: "mha_bias", 5: "bias4", 6: "qcache", 7: "qcache",
    },
    ("", "Attention"): {0: "q", 1: "k", 2: "v", 3: "bias4", 4: "cache", 5: "cache"},
}  # fmt: skip
# Output roles: "out" (the attention output), "cache" (present by KV heads), "qhead" (axis 1
# by query heads).
_OUTPUTS = {
    (MS, "GroupQueryAttention"): ("out", "cache", "cache", "qhead"),
    (MS, "MultiHeadAttention"): ("out", "qhead", "qhead", "qhead"),
    ("", "Attention"): ("out", "cache", "cache", "qhead"),
}


@dataclass(frozen=True)
class _Heads:
    """An attention op's head counts, how its inputs are laid out, and each device's heads."""

    heads: int
    kv_heads: int
    rank: int  # 3: (batch, sequence, hidden); 4: (batch, heads, sequence, size)
    packed: bool  # GroupQueryAttention's query holds q, k and v
    q: Parts
    kv: Parts


def _counts(node: ir.Node) -> tuple[int, int, int, bool] | None:
    """(query heads, KV heads, input rank, packed QKV) from the attributes or shapes; None
    when they cannot be read (the op then runs whole)."""
    key = (node.domain, node.op_type)
    q = node.inputs[0]
    shape = dims(q) if q is not None else None
    if shape is None:
        return None
    k = node.inputs[1] if len(node.inputs) > 1 else None
    if key == (MS, "GroupQueryAttention"):
        return attr_value(node, "num_heads", 0), attr_value(node, "kv_num_heads", 0), 3, k is None
    if key == (MS, "MultiHeadAttention"):
        if len(shape) != 3 or k is None or len(dims(k) or []) == 5:
            raise InputError(
                f"op {node.name!r} (MultiHeadAttention): packed QKV or KV inputs cannot be split by heads"
            )
        heads = attr_value(node, "num_heads", 0)
        return heads, heads, 3, False
    if len(shape) == 4:
        kshape = dims(k) if k is not None else None
        if kshape is None or not isinstance(shape[1], int) or not isinstance(kshape[1], int):
            return None
        return shape[1], kshape[1], 4, False
    heads, kv = attr_value(node, "q_num_heads", None), attr_value(node, "kv_num_heads", None)
    if heads is None or kv is None:
        return None
    return heads, kv, 3, False


def _plan(node: ir.Node, degree: int) -> _Heads | None:
    counts = _counts(node)
    if counts is None:
        return None
    heads, kv, rank, packed = counts
    if node.op_type == "GroupQueryAttention" and (
        attr_value(node, "kv_cache_bit_width", 0)
        or any(attr_value(node, k, "NONE") not in ("NONE", b"NONE") for k in ("k_quant_type", "v_quant_type"))
    ):
        raise InputError(
            f"op {node.name!r} (GroupQueryAttention): a quantized KV cache cannot be split by heads"
        )
    q_parts, kv_parts = head_plan(node.name, node.op_type, heads, kv, degree)
    return _Heads(heads, kv, rank, packed, q_parts, kv_parts)


def attention_sections(
    node: ir.Node, index: int, off: int, length: int, degree: int
) -> list[tuple[int, int, int]]:
    """The (offset, length, block) sections of the last axis of ``node``'s input ``index``
    (``length`` long, at ``off`` in the column-parallel output feeding it): the query
    section in blocks of one KV group's query heads (where the KV heads spread over the
    devices) or of one head, the key and value sections in heads.

    Raises:
        InputError: the heads cannot be split over ``degree`` devices.
    """
    found = _plan(node, degree)
    if found is None or found.rank != 3 or index > 2:
        return []
    heads, kv = found.heads, found.kv_heads
    q_block = heads // kv if kv >= degree else 1
    if found.packed and index == 0:
        if length % (heads + 2 * kv):
            return []
        size = length // (heads + 2 * kv)
        return [
            (off, heads * size, q_block * size),
            (off + heads * size, kv * size, size),
            (off + (heads + kv) * size, kv * size, size),
        ]
    count = heads if index == 0 else kv
    if length % count:
        return []
    return [(off, length, (q_block if index == 0 else 1) * (length // count))]


def _hidden(value: ir.Value, heads: int, parts: Parts) -> Layout | None:
    """A rank-3 ``(batch, sequence, heads * size)`` value's columns of each device's ``parts``."""
    shape = dims(value)
    if shape is None or len(shape) != 3 or not isinstance(shape[2], int) or shape[2] % heads:
        return None
    return Layout("S", 2, shape[2], expand_parts(parts, shape[2] // heads))


def _packed(value: ir.Value, plan: _Heads) -> Layout | None:
    shape = dims(value)
    total = plan.heads + 2 * plan.kv_heads
    if shape is None or len(shape) != 3 or not isinstance(shape[2], int) or shape[2] % total:
        return None
    size = shape[2] // total
    q, kv = expand_parts(plan.q, size), expand_parts(plan.kv, size)
    k_off, v_off = plan.heads * size, (plan.heads + plan.kv_heads) * size
    parts = tuple(
        tuple(sorted({*qd, *(k_off + i for i in kd), *(v_off + i for i in kd)})) for qd, kd in zip(q, kv)
    )
    return Layout("S", 2, shape[2], parts)


def _head_axis(value: ir.Value, axis: int, count: int, parts: Parts, *, one: bool = True) -> Layout | None:
    """Axis ``axis`` of ``value`` by heads, where it is ``count`` long (else None: read whole).
    ``one=False``: an axis of 1 broadcasts (a bias or mask shared by the heads), read whole."""
    shape = dims(value)
    if shape is None or len(shape) <= axis or shape[axis] != count or (count == 1 and not one):
        return None
    return Layout("S", axis, count, parts)


def _mha_bias(value: ir.Value, plan: _Heads) -> list[tuple[int, ...]] | None:
    """Per device, the elements of ``MultiHeadAttention``'s ``(3 * hidden,)`` bias it reads."""
    shape = dims(value)
    if shape is None or len(shape) != 1 or not isinstance(shape[0], int) or shape[0] % 3:
        return None
    hidden = shape[0] // 3
    cols = expand_parts(plan.q, hidden // plan.heads)
    return [tuple(j * hidden + i for j in range(3) for i in part) for part in cols]


def _input_layout(node: ir.Node, role: str, value: ir.Value, plan: _Heads) -> Layout | None:
    """How device ``d`` reads input ``value`` of ``role`` (None: whole)."""
    if role == "q":
        if plan.packed:
            return _packed(value, plan)
        if plan.rank == 4:
            return _head_axis(value, 1, plan.heads, plan.q)
        return _hidden(value, plan.heads, plan.q)
    if role in ("k", "v"):
        heads, parts = (
            (plan.heads, plan.q) if node.op_type == "MultiHeadAttention" else (plan.kv_heads, plan.kv)
        )
        if plan.rank == 4 or len(dims(value) or []) == 4:
            return _head_axis(value, 1, heads, parts)
        return _hidden(value, heads, parts)
    if role == "cache":
        return _head_axis(value, 1, plan.kv_heads, plan.kv)
    if role == "qcache":
        return _head_axis(value, 1, plan.heads, plan.q)
    if role == "bias4":  # broadcast to (batch, heads, S, T): the head axis is third from last
        rank = len(dims(value) or [])
        return _head_axis(value, rank - 3, plan.heads, plan.q, one=False) if rank >= 3 else None
    if role == "sink":
        return _head_axis(value, 0, plan.heads, plan.q, one=False)
    return None


def _local_input(rw: Rewriter, node: ir.Node, index: int, plan: _Heads, d: int) -> ir.Value | None:
    value = node.inputs[index]
    if value is None:
        return None
    role = _INPUTS[(node.domain, node.op_type)].get(index)
    if role is None:
        return rw.replicated(value, d)
    if role == "refuse":
        raise InputError(
            f"op {node.name!r} ({node.op_type}): its input {index} ({value.name!r}, KV scales of a "
            "quantized cache) cannot be split by heads"
        )
    if role == "mha_bias":
        rows = _mha_bias(value, plan)
        if rows is None or value.const_value is None:
            raise InputError(
                f"op {node.name!r} (MultiHeadAttention): its bias {value.name!r} "
                "is not a (3 * hidden) constant"
            )
        return rw.param_shard(value, 0, rows[d], d)
    layout = _input_layout(node, role, value, plan)
    if layout is None:
        if role in ("q", "k", "v", "cache"):
            raise InputError(
                f"op {node.name!r} ({node.op_type}) with {plan.heads} query heads and {plan.kv_heads} KV "
                f"heads: its input {value.name!r} {value.shape} is not laid out by heads"
            )
        return rw.replicated(value, d)
    return rw.as_shard(value, layout, d)


def _output_layout(node: ir.Node, role: str, value: ir.Value, plan: _Heads) -> Layout:
    if role == "cache":
        found = _head_axis(value, 1, plan.kv_heads, plan.kv)
    elif role == "qhead":
        found = _head_axis(value, 1, plan.heads, plan.q)
    elif plan.rank == 4:
        found = Layout("S", 1, plan.heads, plan.q)
    else:
        found = _hidden(value, plan.heads, plan.q)
    if found is None:
        raise InputError(
            f"op {node.name!r} ({node.op_type}): its output {value.name!r} {value.shape} has no static "
            "head axis to split"
        )
    return found


def _attention(rw: Rewriter, node: ir.Node, policy: object) -> bool:
    """Split an attention op by heads (see the module docstring); False: it runs whole."""
    allows = getattr(policy, "allows", None)
    if allows is not None and not allows(node):
        return False
    if any(rw.layout(v).kind == "P" for v in node.inputs if v is not None):
        return False
    plan = _plan(node, rw.t)
    if plan is None:
        return False
    key = (node.domain, node.op_type)
    roles = _OUTPUTS[key]
    layouts = [_output_layout(node, roles[i], out, plan) for i, out in enumerate(node.outputs)]
    clones = []
    for d in range(rw.t):
        inputs = [_local_input(rw, node, i, plan, d) for i in range(len(node.inputs))]
        attrs = dict(node.attributes)
        if key == ("", "Attention"):
            if "q_num_heads" in attrs:
                attrs["q_num_heads"] = ir.AttrInt64("q_num_heads", len(plan.q[d]))
                attrs["kv_num_heads"] = ir.AttrInt64("kv_num_heads", len(plan.kv[d]))
        else:
            attrs["num_heads"] = ir.AttrInt64("num_heads", len(plan.q[d]))
            if key == (MS, "GroupQueryAttention"):
                attrs["kv_num_heads"] = ir.AttrInt64("kv_num_heads", len(plan.kv[d]))
        clones.append(rw.clone(node, inputs, d, layouts, attributes=attrs))
    rw.set_outputs(node, layouts, clones)
    rw.split.append(node.name or "")
    return True


def _rotary(rw: Rewriter, node: ir.Node, policy: object) -> bool:
    """``RotaryEmbedding`` (ONNX or ``com.microsoft``) rotates each head by itself: an input
    sharded in whole heads (of its hidden axis, or the head axis of a 4-D input) stays so,
    with ``num_heads`` each device's own; the cos/sin caches and positions are read whole."""
    x = node.inputs[0]
    lay, shape = rw.layout(x), dims(x) if x is not None else None
    if (
        lay.kind != "S"
        or shape is None
        or any(rw.layout(v).kind != "R" for v in node.inputs[1:] if v is not None)
    ):
        return False
    attrs = [dict(node.attributes) for _ in range(rw.t)]
    if len(shape) == 4:
        if lay.axis != 1:
            return False
    else:
        heads = attr_value(node, "num_heads", 0)
        cos = node.inputs[2 if node.domain == MS else 1]
        cos_dims = dims(cos) if cos is not None else None
        if len(shape) != 3 or lay.axis != 2 or not isinstance(shape[2], int):
            return False
        if heads:
            size = shape[2] // heads
        elif cos_dims and isinstance(cos_dims[-1], int) and not attr_value(node, "rotary_embedding_dim", 0):
            size = 2 * cos_dims[-1]
        else:
            return False
        for d, part in enumerate(lay.parts):
            owned = sorted({i // size for i in part})
            if list(part) != [h * size + j for h in owned for j in range(size)]:
                return False  # a shard cuts a head
            if heads:
                attrs[d]["num_heads"] = ir.AttrInt64("num_heads", len(owned))
    clones = [
        rw.clone(
            node,
            [rw.local(x, d), *(rw.replicated(v, d) for v in node.inputs[1:])],
            d,
            [lay],
            attributes=attrs[d],
        )
        for d in range(rw.t)
    ]
    rw.set_outputs(node, [lay], clones)
    return True


#: Ops that make heads of their query, key and value inputs (read by the column plan).
HEAD_OPS = frozenset({("", "Attention"), (MS, "GroupQueryAttention"), (MS, "MultiHeadAttention")})
#: Ops that keep a shard of whole heads as it is (the column plan looks through them).
PER_HEAD_OPS = frozenset({("", "RotaryEmbedding"), (MS, "RotaryEmbedding")})

#: (domain, op type) -> rule(rewriter, node, policy) -> handled
ATTENTION_RULES: dict[tuple[str, str], Callable[[Rewriter, ir.Node, object], bool]] = {
    **dict.fromkeys(HEAD_OPS, _attention),
    **dict.fromkeys(PER_HEAD_OPS, _rotary),
}
