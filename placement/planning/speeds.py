"""Device speeds: FLOP/s per device type, measured on this machine or a stated default.

The offload planner (:func:`placement.plan_offload`, and :func:`placement.auto_place` for a
budget of one GPU plus the host) needs to know how much faster the GPU is than the host:
without it a plan cannot tell a layer computed on the host from one computed on the GPU.
:func:`device_speeds` says, per device type, how many FLOP/s an op achieves there:

* given by the caller (``throughput={"cuda": 60e12}``): used as is;
* measured here: the host by timing a float32 matrix product on the CPU, a GPU by the same
  product on it (only when torch sees that GPU; a GPU emulated on the CPU is never measured);
* otherwise the stated default, :data:`DEFAULT_FLOPS`:

  ======  ===============  ==================================================
  type    default FLOP/s   what it stands for
  ======  ===============  ==================================================
  cuda    50e12            a data-centre GPU in float32 (TF32 off) or a
                           consumer GPU in half precision
  cpu     0.5e12           a many-core server CPU in float32
  ======  ===============  ==================================================

A GPU is then 100 times the host: measured machines range from tens (a workstation GPU
beside a large server CPU) to a few thousand (an H100 in half precision beside a few busy
cores). Only the ratio between the two devices and each device's time against the link
matter to the plan.

Example:
    >>> from placement.planning.speeds import device_speeds
    >>> speeds = device_speeds({"cpu": 2e11}, measure=False)
    >>> speeds.rates["cpu"], speeds.rates["cuda"], speeds.sources["cuda"]
    (200000000000.0, 50000000000000.0, 'default')
    >>> speeds.ratio("cuda", "cpu")
    250.0
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from placement.errors import PlanError

__all__ = ["DEFAULT_FLOPS", "DeviceSpeeds", "device_speeds", "measure_flops"]

log = logging.getLogger(__name__)

#: FLOP/s assumed for a device type that is neither given nor measured (see the module docstring).
DEFAULT_FLOPS: dict[str, float] = {"cuda": 50e12, "cpu": 0.5e12}

#: Side of the square float32 matrix product timed to measure a device (2 * n**3 FLOPs).
_MEASURE_SIDE = {"cpu": 512, "cuda": 4096}


@dataclass(frozen=True)
class DeviceSpeeds:
    """FLOP/s per device type and where each figure comes from.

    Attributes:
        rates: device type (``"cuda"``, ``"cpu"``) -> FLOP/s.
        sources: device type -> ``"given"``, ``"measured"`` or ``"default"``.
    """

    rates: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def ratio(self, fast: str, slow: str) -> float:
        """How many times ``fast``'s rate is ``slow``'s."""
        return self.rates[fast] / self.rates[slow]

    def describe(self) -> str:
        """``"cuda 50.0 TFLOP/s (default), cpu 0.08 TFLOP/s (measured)"``."""
        return ", ".join(
            f"{kind} {rate / 1e12:.3g} TFLOP/s ({self.sources[kind]})" for kind, rate in self.rates.items()
        )


def _check_rates(throughput: Mapping[str, float]) -> dict[str, float]:
    rates: dict[str, float] = {}
    for kind, rate in throughput.items():
        if kind not in DEFAULT_FLOPS:
            known = ", ".join(DEFAULT_FLOPS)
            raise PlanError(f"throughput names device type {kind!r}; expected one of {known}")
        number = isinstance(rate, (int, float)) and not isinstance(rate, bool)
        if not number or not rate > 0 or not math.isfinite(rate):
            raise PlanError(f"throughput[{kind!r}] must be a positive number of FLOP/s, got {rate!r}")
        rates[kind] = float(rate)
    return rates


@functools.cache
def measure_flops(kind: str, index: int = 0, *, repeats: int = 5) -> float | None:
    """FLOP/s of a float32 matrix product on ``cpu`` or ``cuda:index`` (best of ``repeats``), or None.

    None when the device cannot be measured here: no torch, or no such GPU. Cached per
    process: a device is measured once.

    Example:
        >>> rate = measure_flops("cpu", repeats=2)
        >>> rate is None or rate > 1e6
        True
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of the package
        return None
    if kind == "cuda" and (not torch.cuda.is_available() or index >= torch.cuda.device_count()):
        return None
    if kind not in _MEASURE_SIDE:
        return None
    side = _MEASURE_SIDE[kind]
    device = torch.device(kind, index) if kind == "cuda" else torch.device("cpu")
    a = torch.randn(side, side, device=device)
    b = torch.randn(side, side, device=device)
    best = math.inf
    with torch.no_grad():
        torch.matmul(a, b)  # warm up
        for _ in range(max(1, repeats)):
            if kind == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.matmul(a, b)
            if kind == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
    rate = 2.0 * side**3 / max(best, 1e-9)
    log.info("measured %s:%d at %.3g GFLOP/s (float32 %dx%d matmul)", kind, index, rate / 1e9, side, side)
    return rate


def device_speeds(
    throughput: Mapping[str, float] | None = None, *, measure: bool = True, gpu_index: int = 0
) -> DeviceSpeeds:
    """FLOP/s of the GPU and the host: given, else measured here (``measure``), else :data:`DEFAULT_FLOPS`.

    Args:
        throughput: device type -> FLOP/s to use as given (``{"cuda": 60e12, "cpu": 1e12}``).
        measure: time the devices this machine has (the host always; ``cuda:gpu_index`` when
            torch sees it) for the types not given.
        gpu_index: which GPU to measure.

    Raises:
        PlanError: a rate that is not a positive number, or an unknown device type.

    Example:
        >>> device_speeds({"cuda": 1e13, "cpu": 1e11}).describe()
        'cuda 10 TFLOP/s (given), cpu 0.1 TFLOP/s (given)'
    """
    given = _check_rates(throughput or {})
    rates: dict[str, float] = {}
    sources: dict[str, str] = {}
    for kind, default in DEFAULT_FLOPS.items():
        if kind in given:
            rates[kind], sources[kind] = given[kind], "given"
            continue
        measured = measure_flops(kind, gpu_index) if measure else None
        if measured is not None:
            rates[kind], sources[kind] = measured, "measured"
        else:
            rates[kind], sources[kind] = default, "default"
    return DeviceSpeeds(rates=rates, sources=sources)
