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


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests, with the reason, where torch sees no CUDA GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch sees none)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
