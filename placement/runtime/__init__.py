"""Runtimes: device maps, per-device ONNX Runtime stages and the torch lowering."""

from __future__ import annotations

from placement.runtime.device_map import PhysicalDevice, resolve_device_map

__all__ = ["PhysicalDevice", "resolve_device_map"]
