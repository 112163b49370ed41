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
