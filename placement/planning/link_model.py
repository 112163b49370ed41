"""Link model: how long moving a blob between two devices takes.

A :class:`Link` is a bandwidth (bytes per second) and a latency (seconds per copy);
moving ``n`` bytes costs ``latency + n / bandwidth``. :class:`Links` gives the link
of every ordered pair of devices: explicit pairs first, else a default chosen by the
device types (two GPUs: :data:`PRESETS` ``"pcie"``; a GPU and the host: ``"host"``;
two CPU devices, i.e. emulated ones: ``"memcpy"``), or one link for every pair.

The presets are typical figures, not measurements of this machine; for those, time
real copies with :func:`placement.measure_links`.

Example:
    >>> from placement.planning.link_model import Link, Links
    >>> links = Links({("cuda:0", "cuda:1"): "nvlink"}, default="pcie")
    >>> links.link("cuda:0", "cuda:1").bandwidth > links.link("cuda:1", "cuda:2").bandwidth
    True
    >>> Link(bandwidth=1e9, latency=1e-5).time_ns(10**6)  # 10 us + 1 ms
    1010000
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from placement.errors import PlanError
from placement.graph.device import Device, DeviceLike

__all__ = ["Link", "Links", "PRESETS", "LinksLike", "resolve_links"]


@dataclass(frozen=True)
class Link:
    """One direction of an interconnect.

    Attributes:
        bandwidth: bytes per second (positive).
        latency: seconds per copy, whatever its size (non-negative).
    """

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not (
            isinstance(self.bandwidth, (int, float)) and math.isfinite(self.bandwidth) and self.bandwidth > 0
        ):
            raise PlanError(
                f"a link's bandwidth must be a positive number of bytes/s, got {self.bandwidth!r}"
            )
        if not (isinstance(self.latency, (int, float)) and math.isfinite(self.latency) and self.latency >= 0):
            raise PlanError(
                f"a link's latency must be a non-negative number of seconds, got {self.latency!r}"
            )

    def time_ns(self, nbytes: int) -> int:
        """Nanoseconds to move ``nbytes`` (0 bytes move for free: nothing is copied)."""
        if nbytes <= 0:
            return 0
        return int(math.ceil(self.latency * 1e9 + nbytes * 1e9 / self.bandwidth))

    def __str__(self) -> str:
        return f"{self.bandwidth / 1e9:.3g} GB/s + {self.latency * 1e6:.3g} us"


#: Typical links: NVLink (one direction of a recent GPU pair), PCIe 4.0 x16 peer to
#: peer, host <-> GPU over PCIe, and a copy in host memory (CPU-emulated devices).
PRESETS: dict[str, Link] = {
    "nvlink": Link(bandwidth=150e9, latency=3e-6),
    "pcie": Link(bandwidth=20e9, latency=10e-6),
    "host": Link(bandwidth=12e9, latency=10e-6),
    "memcpy": Link(bandwidth=8e9, latency=5e-6),
}

LinkLike = Union[Link, str]
LinksLike = Union["Links", Link, str, Mapping[Any, Any], None]


def _link(spec: Any) -> Link:
    if isinstance(spec, Link):
        return spec
    if isinstance(spec, str):
        try:
            return PRESETS[spec.lower()]
        except KeyError:
            raise PlanError(f"unknown link {spec!r}; presets are {', '.join(PRESETS)}") from None
    raise PlanError(f"not a link: {spec!r} (use a Link or one of {', '.join(PRESETS)})")


class Links:
    """Links between devices: explicit ordered pairs, else a default.

    Args:
        pairs: ``(source, destination) -> Link`` or preset name; a pair given one way
            only is used both ways.
        default: a :class:`Link` or preset for every other pair, or ``"auto"``: by the
            device types (see the module docstring).
    """

    def __init__(self, pairs: Mapping[Any, LinkLike] | None = None, *, default: LinkLike = "auto") -> None:
        self.pairs: dict[tuple[Device, Device], Link] = {}
        for key, spec in (pairs or {}).items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise PlanError(f"links are keyed by (source, destination) device pairs, got {key!r}")
            src, dst = Device.parse(key[0]), Device.parse(key[1])
            self.pairs[(src, dst)] = _link(spec)
        self.default: Link | None = None if default == "auto" else _link(default)

    def link(self, src: DeviceLike, dst: DeviceLike) -> Link:
        """The link from ``src`` to ``dst``."""
        a, b = Device.parse(src), Device.parse(dst)
        found = self.pairs.get((a, b)) or self.pairs.get((b, a))
        if found is not None:
            return found
        if self.default is not None:
            return self.default
        if a.type == "cuda" and b.type == "cuda":
            return PRESETS["pcie"]
        if a.type == "cuda" or b.type == "cuda":
            return PRESETS["host"]
        return PRESETS["memcpy"]

    def uniform_into(self, devices: list[Device]) -> bool:
        """True if, for every device, all links into it from earlier ones are alike."""
        for k in range(2, len(devices)):
            if len({self.link(devices[s], devices[k]) for s in range(k)}) > 1:
                return False
        return True

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description."""
        return {
            "default": None if self.default is None else vars(self.default),
            "pairs": {f"{a}->{b}": vars(link) for (a, b), link in self.pairs.items()},
        }

    def __repr__(self) -> str:
        pairs = ", ".join(f"{a}->{b}: {link}" for (a, b), link in self.pairs.items())
        return f"Links({{{pairs}}}, default={'auto' if self.default is None else str(self.default)})"


def resolve_links(spec: LinksLike) -> Links | None:
    """``links=`` of :func:`placement.auto_place` as a :class:`Links` (None: no link costs).

    Accepts a :class:`Links`, one :class:`Link` or preset name for every pair,
    ``"auto"`` (by device types), a mapping ``(source, destination) -> link``, or
    None/False (transfers cost nothing).
    """
    if spec is None or spec is False:
        return None
    if isinstance(spec, Links):
        return spec
    if isinstance(spec, str) and spec == "auto":
        return Links()
    if isinstance(spec, (Link, str)):
        return Links(default=spec)
    if isinstance(spec, Mapping):
        return Links(spec)
    raise PlanError(
        f"links must be a Links, a Link, a preset name or a mapping of device pairs, got {spec!r}"
    )
