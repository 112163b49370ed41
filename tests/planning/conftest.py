"""Fixtures shared by the planning tests: the 4-layer d=256 GPT exported once per session."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from placement.models.gpt import GPT
from tests.planning.helpers import SMALL_GPT


@pytest.fixture(scope="session")
def small_gpt_export(tmp_path_factory):
    """``(net, path)``: the 4-layer d=256 GPT (seeded) and its export at 1 x 32 tokens, saved once."""
    torch.manual_seed(0)
    net = GPT(SMALL_GPT).eval()
    model = pl.from_torch(net, (torch.randint(0, SMALL_GPT.vocab_size, (1, 32)),))
    path = tmp_path_factory.mktemp("gpt4") / "gpt4.onnx"
    model.save(path)
    return net, path
