"""Which query heads and KV heads each device of a group computes in an attention op.

Both the column plan of the linears that make an attention op's query, key and value
(:func:`placement.passes.tensor_parallel.weights.column_plan`) and the attention rule
(:mod:`.rules_attention`) read :func:`head_plan`, so the columns a linear computes on a
device are the heads that device's attention reads.

* ``kv_heads >= degree``: the KV heads spread over the devices (ragged where they do not
  divide, the first devices taking one more), each device with the query heads of its KV
  heads (whole groups of grouped-query attention);
* ``kv_heads < degree`` and ``degree % kv_heads == 0``: each KV head lives on the
  ``degree / kv_heads`` devices whose query heads read it (replicated KV heads); the query
  heads spread evenly, each device's within one group.

Anything else raises an :class:`~placement.errors.InputError` naming the op and its head
counts.

Example:
    >>> head_plan("attn", "GroupQueryAttention", 4, 2, 2)
    (((0, 1), (2, 3)), ((0,), (1,)))
    >>> head_plan("attn", "GroupQueryAttention", 8, 1, 2)  # one KV head, on both devices
    (((0, 1, 2, 3), (4, 5, 6, 7)), ((0,), (0,)))
"""

from __future__ import annotations

from placement.errors import InputError
from placement.passes.tensor_parallel.layouts import Parts, block_parts

__all__ = ["head_plan"]


def head_plan(name: str | None, op_type: str, heads: int, kv_heads: int, degree: int) -> tuple[Parts, Parts]:
    """Per device, (its query heads, its KV heads) of an attention op with ``heads`` query
    heads and ``kv_heads`` KV heads split over ``degree`` devices (see the module docstring).

    Raises:
        InputError: the counts are not positive, the query heads are not whole groups of the
            KV heads, or the heads cannot be spread over ``degree`` devices.
    """
    what = f"op {name!r} ({op_type}) with {heads} query heads and {kv_heads} KV heads"
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise InputError(f"{what}: the query heads must be a positive multiple of the KV heads")
    group = heads // kv_heads
    try:
        kv = block_parts(kv_heads, degree)
        if kv_heads >= degree:
            q = tuple(tuple(h for k in part for h in range(k * group, (k + 1) * group)) for part in kv)
        else:
            q = block_parts(heads, degree)
    except InputError:
        q = kv = ()
    if not q or not _consistent(q, kv, group):
        raise InputError(
            f"{what} cannot be split over {degree} devices: the KV heads must be at least the "
            "degree, or divide it with the query heads divisible by the degree (each device "
            "holding whole heads of one KV group)"
        )
    return q, kv


def _consistent(q: Parts, kv: Parts, group: int) -> bool:
    """Whether each device's local query head ``i`` reads its local KV head ``i // (local group)``."""
    for qd, kd in zip(q, kv):
        if not qd or not kd or len(qd) % len(kd):
            return False
        local = len(qd) // len(kd)
        if any(kd[i // local] != h // group for i, h in enumerate(qd)):
            return False
    return True
