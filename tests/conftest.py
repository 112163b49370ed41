"""Shared fixtures: tiny models from ``models/`` exported once per session."""

from __future__ import annotations

import functools

import pytest

import placement as pl


@functools.cache
def export_once(name: str) -> tuple[pl.Model, object, tuple]:
    from placement import models

    net, args = models.build(name, "tiny")
    return pl.from_torch(net, args), net, args


@pytest.fixture
def exported():
    """``exported(name) -> (model, module, args)``: a fresh copy of the model each call."""

    def get(name: str):
        model, net, args = export_once(name)
        return model.copy(), net, args

    return get


MODEL_NAMES = ["mlp", "resnet", "gpt", "unet"]


def _has_gpu() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    try:  # onnxruntime-gpu lists its CUDA provider whether or not a GPU is present: count devices
        from placement.runtime.device_map import cuda_device_count

        return cuda_device_count("ort") > 0
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` tests, with the reason, where no GPU is visible."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch) or onnxruntime's CUDAExecutionProvider")
        for item in gpu_items:
            item.add_marker(skip)
