"""Which logical devices each rank runs: the rank map.

A placed model's logical devices are given to ranks in *pipeline order* (the
order in which the devices first compute an activation, walking the graph in
topological order). By default each rank runs one logical device; a rank may
also run a group of devices (``"cuda:0+cuda:1,cuda:2"``: rank 0 runs the first
two, rank 1 the third), e.g. to fit a placement made for 4 GPUs on 2 hosts.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.distributed.ranks import rank_groups
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> [[str(d) for d in group] for group in rank_groups(model)]
    [['cuda:0'], ['cuda:1']]
    >>> [[str(d) for d in group] for group in rank_groups(model, ranks="cuda:1+cuda:0")]
    [['cuda:0', 'cuda:1']]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from placement.errors import DeviceError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import is_copy_node, node_device

__all__ = ["RanksLike", "pipeline_devices", "rank_groups", "format_groups"]

#: What ``ranks=`` accepts: ``"cuda:0,cuda:1"`` / ``"0+1,2"``, or a sequence of devices or device groups.
RanksLike = Union[str, Sequence[Any], None]


def pipeline_devices(model: Model) -> list[Device]:
    """The model's logical devices in pipeline order (first activation computed on each).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> [str(d) for d in pipeline_devices(model)]
        ['cuda:0']
    """
    from placement.passes import get_activation_blobs

    producing: set[str] = set(get_activation_blobs(model))
    order: list[Device] = []
    for node in model.graph:
        if is_copy_node(node):
            continue
        if any(out.name in producing for out in node.outputs):
            device = node_device(node)
            if device not in order:
                order.append(device)
    rest = sorted(set(model.devices) - set(order))
    return order + rest


def rank_groups(model: Model, *, ranks: RanksLike = None) -> list[list[Device]]:
    """The logical devices of each rank, rank 0 first.

    Args:
        model: the placed model.
        ranks: ``None`` (one device per rank, pipeline order), a string such as
            ``"cuda:0,cuda:1"`` or ``"0+1,2"`` (commas separate ranks, ``+`` joins
            devices run by one rank), or a sequence whose items are devices or
            sequences of devices. Every device of the model must appear exactly once.

    Raises:
        DeviceError: an unknown, repeated or missing device, or an empty rank.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> rank_groups(model, ranks="cuda:0")
        [[Device('cuda:0')]]
    """
    order = pipeline_devices(model)
    if ranks is None:
        return [[d] for d in order]
    groups = _parse(ranks)
    known = set(order)
    seen: dict[Device, int] = {}
    for r, group in enumerate(groups):
        if not group:
            raise DeviceError(f"rank {r} of ranks={ranks!r} has no device")
        for device in group:
            if device not in known:
                raise DeviceError(
                    f"ranks={ranks!r} names device {device}, which the model does not use "
                    f"(its devices: {', '.join(map(str, order))})"
                )
            if device in seen:
                raise DeviceError(f"ranks={ranks!r} gives device {device} to ranks {seen[device]} and {r}")
            seen[device] = r
    missing = [str(d) for d in order if d not in seen]
    if missing:
        raise DeviceError(f"ranks={ranks!r} gives no rank to device(s) {', '.join(missing)}")
    return [sorted(group, key=order.index) for group in groups]


def format_groups(groups: Sequence[Sequence[Device]]) -> list[str]:
    """``[[cuda:0, cuda:1], [cuda:2]]`` -> ``["cuda:0+cuda:1", "cuda:2"]``.

    Example:
        >>> format_groups([[Device("cuda", 0)], [Device("cuda", 1)]])
        ['cuda:0', 'cuda:1']
    """
    return ["+".join(str(d) for d in group) for group in groups]


def _parse(ranks: str | Sequence[Any]) -> list[list[Device]]:
    if isinstance(ranks, str):
        text = ranks.strip()
        if not text:
            raise DeviceError("ranks='' names no device")
        return [[Device.parse(p.strip()) for p in item.split("+") if p.strip()] for item in text.split(",")]
    groups: list[list[Device]] = []
    for item in ranks:
        if isinstance(item, (list, tuple)):
            groups.append([Device.parse(d) for d in item])
        elif isinstance(item, str) and "+" in item:
            groups.append([Device.parse(p.strip()) for p in item.split("+")])
        else:
            groups.append([Device.parse(item)])
    return groups
