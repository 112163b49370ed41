"""Measure the links between devices: time real copies the ONNX Runtime executor makes.

:func:`measure_links` moves tensors of two sizes between every ordered pair of
devices exactly as :class:`placement.Runner` moves a blob between stages (the same
transfer kinds: GPU to GPU, host to GPU, GPU to host; logical devices emulated on
the CPU share host memory, so their "copy" hands the value over and the fitted link
is all but free, which is what the emulation pays), and fits a latency and a
bandwidth per pair. The result feeds ``pl.auto_place(..., links=...)``; to plan for
GPUs while running emulated, give their links instead (``links="nvlink"``, or the
default, typical links by device type).

Example:
    >>> import placement as pl
    >>> links = pl.measure_links(["cuda:0", "cuda:1"], device_map="cpu", repeats=3)
    >>> link = links.link("cuda:0", "cuda:1")
    >>> link.bandwidth > 0 and link.latency >= 0
    True
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence

import numpy as np

from placement.errors import PlanError
from placement.graph.device import Device, DeviceLike
from placement.planning.link_model import Link, Links
from placement.runtime.device_map import DeviceMapLike, cuda_device_count, resolve_device_map

__all__ = ["measure_links"]

log = logging.getLogger(__name__)


def measure_links(
    devices: Sequence[DeviceLike] | None = None,
    *,
    device_map: DeviceMapLike = "auto",
    sizes: tuple[int, int] = (4 << 10, 8 << 20),
    repeats: int = 10,
) -> Links:
    """Time copies between every ordered pair of ``devices``; return the fitted :class:`Links`.

    Args:
        devices: logical devices (default: every GPU the runtime sees, or ``cuda:0`` and
            ``cuda:1`` emulated on the CPU when there are fewer than two).
        device_map: logical -> physical devices, as for :class:`placement.Runner`.
        sizes: the small and the large copy, in bytes: the small one's time is mostly
            latency, the difference between the two gives the bandwidth.
        repeats: timed copies per size and pair (the median counts).

    Raises:
        PlanError: fewer than two devices, or sizes not increasing.
        DeviceError: the device map names a missing GPU.
    """
    from placement.runtime.ort.values import move, ortvalue, transfer_kind

    if devices is None:
        count = cuda_device_count("ort")
        devices = [Device("cuda", k) for k in range(max(2, count))]
    logical = [Device.parse(d) for d in devices]
    if len(set(logical)) < 2:
        raise PlanError(f"measure_links needs two devices or more, got {[str(d) for d in logical]}")
    small, large = sizes
    if not 0 < small < large:
        raise PlanError(f"sizes must be two increasing byte counts, got {sizes!r}")
    dmap = resolve_device_map(logical, device_map, runtime="ort")
    pairs: dict[tuple[Device, Device], Link] = {}
    for src in logical:
        for dst in logical:
            if src == dst:
                continue
            kind = transfer_kind(dmap[src], dmap[dst], same_logical=False)
            times = []
            for nbytes in (small, large):
                value = ortvalue(np.ones(nbytes // 4, dtype=np.float32), dmap[src])
                move(value, kind, dmap[dst])  # warm-up
                samples = []
                for _ in range(max(1, repeats)):
                    t0 = time.perf_counter()
                    move(value, kind, dmap[dst])
                    samples.append(time.perf_counter() - t0)
                times.append(statistics.median(samples))
            t_small, t_large = times
            delta = t_large - t_small
            bandwidth = (large - small) / delta if delta > 0 else large / max(t_large, 1e-9)
            latency = max(0.0, t_small - small / bandwidth)
            pairs[(src, dst)] = Link(bandwidth=bandwidth, latency=latency)
            log.info(
                "link %s -> %s (%s -> %s, %s): %s", src, dst, dmap[src], dmap[dst], kind, pairs[(src, dst)]
            )
    return Links(pairs)
