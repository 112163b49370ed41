"""Review findings on real training mode (:mod:`placement.lowering.ops.training`)."""

from __future__ import annotations

import pytest
import torch

import placement as pl


@pytest.mark.xfail(
    strict=True,
    reason="BatchNorm(momentum=None) (a cumulative average, 1/num_batches_tracked) defeats the "
    "dynamo export with training=True (data-dependent factor); the TorchScript fallback emits "
    "BatchNormalization training_mode=1, which lowering/ops/training.py does not lower "
    "(LoweringError): such a net cannot be trained placed",
)
def test_a_cumulative_average_batchnorm_trains_its_running_stats_like_torch():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, momentum=None))
    x = torch.randn(8, 3)
    model = pl.from_torch(net, (x,), training=True)
    module = pl.to_torch(model, device_map="cpu")
    module.train()
    net.train()
    for _ in range(3):
        batch = torch.randn(8, 3)
        net(batch)
        module(batch)
    want = {k: v for k, v in net.state_dict().items() if "running" in k}
    got = {k: v for k, v in module.state_dict().items() if "running" in k}
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key])
