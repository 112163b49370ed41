"""Edge cases of real training mode (:mod:`placement.lowering.ops.training`)."""

from __future__ import annotations

import torch

import placement as pl


def test_a_cumulative_average_batchnorm_trains_its_running_stats_like_torch():
    """BatchNorm(momentum=None) exports through the TorchScript fallback (the dynamo export
    refuses the data-dependent ``1 / num_batches_tracked``); its lowered mode module keeps the
    count and averages cumulatively, as torch does."""
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
