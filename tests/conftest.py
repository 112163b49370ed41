"""Shared fixtures: tiny models from ``models/`` exported once per session; the ``gpu`` marker."""

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


def torch_cuda_available() -> bool:
    """Whether torch sees a CUDA GPU."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def ort_cuda_available() -> bool:
    """Whether ONNX Runtime can run on a GPU: its CUDAExecutionProvider and a GPU to run it on."""
    from placement.runtime.device_map import cuda_device_count

    return cuda_device_count("ort") > 0


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip, saying why, where neither torch nor ONNX Runtime has a GPU."""
    if torch_cuda_available() or ort_cuda_available():
        return
    reason = "needs a GPU: torch.cuda sees none and onnxruntime has no usable CUDA provider"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _strict_fp32():
    """Tests compare GPU results with the CPU's or eager's in strict fp32: torch's TF32 off
    (ONNX Runtime's is off through ``Runner(precision="fp32")``, the default); a test that
    wants TF32 says so with ``placement.runtime.precision.torch_precision("tf32")``."""
    from placement.runtime.precision import torch_precision

    with torch_precision("fp32"):
        yield
