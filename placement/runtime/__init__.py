"""Runtimes: device maps, per-device ONNX Runtime stages and the torch lowering."""

from __future__ import annotations

from placement.runtime.device_map import PhysicalDevice, resolve_device_map
from placement.runtime.lowering import to_torch
from placement.runtime.ort import Runner, RunnerStats, run
from placement.runtime.stages import Stage, partition

__all__ = ["PhysicalDevice", "resolve_device_map"]

__all__ += ["Runner", "RunnerStats", "run", "Stage", "partition"]
__all__ += ["to_torch"]
