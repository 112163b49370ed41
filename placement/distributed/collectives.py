"""A tensor-parallel split's collectives as ``torch.distributed`` calls, with Megatron's f and g.

A placed model split by :func:`placement.split_tensor_parallel` holds its collectives in
plain ONNX: on each device an all-reduce is a ``Sum`` of every device's copied partial, an
all-gather a ``Concat`` of the copied shards. Run as ranks (one device each), each such
collective becomes one call on the rank's own contribution:

* :class:`AllReduce` (Megatron's *g*): ``torch.distributed.all_reduce`` (sum) of the
  rank's partial. Its backward is the identity on the replicated gradient, since every
  rank reads the result and holds the whole gradient of it. At two ranks the result is
  bitwise the emulated ``Sum`` (``a + b == b + a`` in IEEE arithmetic); at more, gloo's ring
  sums each chunk of the buffer starting at a different rank, so the result differs from
  the device-order ``Sum`` in the last bits (every rank still gets the same bits);
  ``ordered=True`` all-gathers the partials and sums them in device order instead.
* :class:`AllGather`: ``torch.distributed.all_gather`` of the rank's shard, concatenated
  along the axis (ragged shards are padded to the largest and cut back). Its backward takes
  the rank's own slice of the replicated gradient.
* :class:`CopyIn` (Megatron's *f*): the identity where a replicated value enters the ops
  of one rank's shard (a column-parallel linear's input, say). Its backward all-reduces
  the gradient: each rank's shard gives a part of it.

Where only some ranks read a collective's result (the split prunes the replicas that
nothing reads: the graph outputs live on one rank), the gradient is not replicated: then
the backward all-reduces the gradient of the first rank that reads it (the others add
zeros), so every rank gets it, and the ranks that do not read the result start their
backward from it with a zero gradient (:attr:`Collective.dangling`).

Every call counts itself in :attr:`Collective.issued` (``forward`` / ``backward``).

Example:
    >>> spec = CollectiveSpec(kind="all_reduce", id=0, index=0, size=2)
    >>> Collective(spec).extra_repr()
    'all_reduce #0, rank 0 of 2'
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveSpec", "Collective", "CopyIn", "AllReduce", "AllGather"]

log = logging.getLogger(__name__)


@dataclass
class CollectiveSpec:
    """One collective as a rank issues it.

    Attributes:
        kind: ``"all_reduce"`` or ``"all_gather"``.
        id: the collective's id in the placed graph (``placement.collective``).
        index: this rank's place in the collective's group (the order of the ``Sum`` /
            ``Concat`` inputs).
        size: the group size.
        axis: the all-gather's axis.
        sizes: each rank's extent along ``axis`` (all-gather), when the graph knows it.
        readers: the places in the group of the ranks that read the result (all of them
            unless the split pruned some replicas).
        dangling: this rank takes part without reading the result.
        exclusive: the rank's contribution is read by nothing but this collective (so that
            inference may reduce it in its own memory).
    """

    kind: str
    id: int
    index: int
    size: int
    axis: int = 0
    sizes: list[int] | None = None
    readers: list[int] = field(default_factory=list)
    dangling: bool = False
    exclusive: bool = False

    @property
    def everywhere(self) -> bool:
        """Every rank of the group reads the result (Megatron's replicated gradient)."""
        return not self.readers or len(self.readers) == self.size


class Collective(torch.nn.Module):
    """One tagged collective of a rank's stage: an all-reduce or an all-gather of its share.

    ``issued`` is shared by the collectives of one stage (counts per direction).
    """

    def __init__(
        self,
        spec: CollectiveSpec,
        *,
        group: Any = None,
        issued: dict[str, int] | None = None,
        ordered: bool = False,
        comm_device: torch.device | None = None,
    ):
        super().__init__()
        self.spec = spec
        self.group = group
        #: where the collective's buffers live (the host under gloo when the rank computes on a GPU)
        self.comm_device = comm_device
        self.issued = issued if issued is not None else {"forward": 0, "backward": 0}
        #: forward all-reduces as an all-gather of the partials summed in device order on each
        #: rank: bitwise the emulated ``Sum`` at any degree (gloo's ring sums chunks in rotated
        #: orders for t > 2); ``t`` times the bytes of a ring all-reduce
        self.ordered = ordered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.kind == "all_gather":
            return AllGather.apply(x, self)
        if not torch.is_grad_enabled() and self._in_place(x):
            self.issued["forward"] += 1  # inference: a partial is read by its all-reduce only
            dist.all_reduce(x, group=self.group)
            return x
        return AllReduce.apply(x, self)

    def _in_place(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can be reduced in its own memory: a contiguous tensor of its own (not
        a view, not a parameter) where the collective runs, and a plain ring all-reduce."""
        return (
            self.spec.exclusive
            and x._base is None
            and x.is_contiguous()
            and not isinstance(x, torch.nn.Parameter)
            and self.comm_device in (None, x.device)
            and not (self.ordered and self.spec.size > 2)
        )

    def extra_repr(self) -> str:
        return f"{self.spec.kind} #{self.spec.id}, rank {self.spec.index} of {self.spec.size}"

    # -- the calls (forward and backward) -------------------------------------------------

    def all_reduce(self, x: torch.Tensor, direction: str) -> torch.Tensor:
        out = _staged(x, self.comm_device)
        self.issued[direction] += 1
        if self.ordered and direction == "forward" and self.spec.size > 2:
            parts = [torch.empty_like(out) for _ in range(self.spec.size)]
            dist.all_gather(parts, out, group=self.group)
            out = functools.reduce(operator.add, parts)  # the emulated Sum's order
        else:
            dist.all_reduce(out, group=self.group)
        return out.to(x.device)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        axis = spec.axis % x.dim()
        sizes = spec.sizes or [x.shape[axis]] * spec.size
        widest = max(sizes)
        x = x.detach()
        if x.shape[axis] != sizes[spec.index]:
            raise RuntimeError(
                f"all-gather #{spec.id}: rank {spec.index} holds {x.shape[axis]} along axis {axis}, "
                f"the placed graph says {sizes[spec.index]}"
            )
        if x.shape[axis] < widest:  # ragged shards: pad to the widest, cut back after
            pad = list(x.shape)
            pad[axis] = widest - x.shape[axis]
            x = torch.cat([x, x.new_zeros(pad)], axis)
        device = x.device
        x = x.contiguous() if self.comm_device in (None, device) else x.to(self.comm_device)
        parts = [torch.empty_like(x) for _ in range(spec.size)]
        self.issued["forward"] += 1
        dist.all_gather(parts, x, group=self.group)
        return torch.cat([p.narrow(axis, 0, n) for p, n in zip(parts, sizes)], axis).to(device)

    def reduced_gradient(self, grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """The gradient of a result not every rank reads: the first reader's, on every rank."""
        first = self.spec.readers[0] if self.spec.readers else 0
        if grad is None or self.spec.dangling or self.spec.index != first:
            grad = torch.zeros_like(like)
        return self.all_reduce(grad, "backward")


class AllReduce(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) forward; identity backward where every rank reads it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: Collective) -> torch.Tensor:
        ctx.op = op
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device
        return op.all_reduce(x, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        op: Collective = ctx.op
        if op.spec.everywhere and not op.spec.dangling:
            return grad, None
        like = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        return op.reduced_gradient(grad, like), None


class AllGather(torch.autograd.Function):
    """All-gather forward; backward: the rank's own slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: Collective) -> torch.Tensor:
        ctx.op = op
        out = op.all_gather(x)
        ctx.shape, ctx.dtype, ctx.device = out.shape, out.dtype, out.device
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        op: Collective = ctx.op
        spec = op.spec
        if not (spec.everywhere and not spec.dangling):
            grad = op.reduced_gradient(grad, torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device))
        axis = spec.axis % grad.dim()
        sizes = spec.sizes or [grad.shape[axis] // spec.size] * spec.size
        start = sum(sizes[: spec.index])
        return grad.narrow(axis, start, sizes[spec.index]).contiguous(), None


class _CopyInFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: CopyIn) -> torch.Tensor:
        ctx.op = op
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        op: CopyIn = ctx.op
        op.issued["backward"] += 1
        out = _staged(grad, op.comm_device)
        dist.all_reduce(out, group=op.group)
        return out.to(grad.device), None


class CopyIn(torch.nn.Module):
    """Megatron's f: a replicated value entering one rank's shard of the ops. Identity forward;
    the backward all-reduces the gradient (each rank's shard contributes a part)."""

    def __init__(
        self,
        *,
        group: Any = None,
        issued: dict[str, int] | None = None,
        comm_device: torch.device | None = None,
    ):
        super().__init__()
        self.group = group
        self.issued = issued if issued is not None else {"forward": 0, "backward": 0}
        self.comm_device = comm_device

    def forward(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
            return x
        if not x.requires_grad:
            return x
        return _CopyInFn.apply(x, self)


def _staged(x: torch.Tensor, comm_device: torch.device | None) -> torch.Tensor:
    """A contiguous buffer of ``x`` of its own on the device the collective runs on."""
    x = x.detach()
    if comm_device is not None and x.device != comm_device:
        return x.to(comm_device).contiguous()
    return x.contiguous().clone()


def pick(args: Sequence[Any], index: int) -> Any:
    """The ``index``-th input of a lowered ``Sum`` (its arguments) or ``Concat`` (a list first)."""
    if args and isinstance(args[0], (list, tuple)):
        return args[0][index]
    return args[index]
