"""The colours of devices, copies and streamed weights, shared by every picture and the HTML report.

Example:
    >>> device_colour(0), device_colour("cuda:1"), device_colour("cpu")
    ('#4e79a7', '#f28e2b', '#bab0ac')
"""

from __future__ import annotations

import logging

from placement.graph.device import Device, DeviceLike

__all__ = [
    "device_colour",
    "DEVICE_PALETTE",
    "CPU_COLOUR",
    "COPY_EDGE_COLOUR",
    "STREAMED_COLOUR",
    "COLLECTIVE_COLOUR",
]

log = logging.getLogger(__name__)


#: Fill colours of ``cuda:0``, ``cuda:1``, ... (Tableau 10, colour-blind friendly); cycles after 10.
DEVICE_PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#b07aa1",
    "#76b7b2",
    "#edc948",
    "#ff9da7",
    "#9c755f",
    "#8cd17d",
    "#a0cbe8",
)


#: Fill colour of ``cpu`` ops.
CPU_COLOUR = "#bab0ac"


#: Colour of copy (cut) edges.
COPY_EDGE_COLOUR = "#d62728"


#: Border of an op that reads weights streamed from the host every run.
STREAMED_COLOUR = "#1f4fd6"


#: Border of a tensor-parallel collective (an all-reduce or all-gather, drawn as a hexagon).
COLLECTIVE_COLOUR = "#7b1fa2"


def device_colour(device: DeviceLike) -> str:
    """The fill colour of a device in pictures and charts: ``cuda:k`` -> ``DEVICE_PALETTE[k % 10]``.

    Example:
        >>> device_colour(0), device_colour("cuda:1"), device_colour("cpu")
        ('#4e79a7', '#f28e2b', '#bab0ac')
    """
    parsed = Device.parse(device)
    if parsed.type == "cpu":
        return CPU_COLOUR
    return DEVICE_PALETTE[(parsed.index or 0) % len(DEVICE_PALETTE)]
