"""Streamed weights on a real GPU, at sizes where ordering matters: large layers streamed from
pinned host memory on a side stream train like the same model all on the GPU; the measured
cuBLAS workspace is a real one."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from placement.models import mlp
from placement.runtime.precision import tolerance, torch_precision
from tests.gpu import needs_torch_cuda

pytestmark = [pytest.mark.gpu, needs_torch_cuda]

#: the streamed layers of the bench MLP (2048 x 2048 fp32, 16 MiB each), between resident ones
STREAMED = ["fc2", "fc4"]


def _train(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def test_streamed_large_layers_train_like_all_on_the_gpu():
    net, (x,) = mlp.build("bench")
    resident_model = pl.from_torch(net, (x,))
    streamed_model = resident_model.copy()
    result = pl.stream_parameters(streamed_model, STREAMED)
    assert len(result.streamed) == 2 * len(STREAMED)  # weight and bias each
    pl.inject_cross_device_copies(streamed_model, output_device=0)
    pl.verify(streamed_model)
    resident = pl.to_torch(resident_model, device_map={"cuda:0": "cuda:0"})
    streamed = pl.to_torch(streamed_model, device_map={"cuda:0": "cuda:0", "cpu": "cpu"})
    path = streamed.initializer_paths
    for name in result.streamed:
        param = streamed.get_parameter(path[name])
        assert param.device.type == "cpu" and param.is_pinned(), name
    streamer = streamed.weight_streamer
    streamer.timing = True
    xc = x.cuda()
    with torch.no_grad():
        y = torch.tanh(net.cuda()(xc)).detach()  # a target the model can move towards
    tol = tolerance("fp32", on_gpu=True)
    with torch_precision("fp32"):
        want = _train(resident, xc, y, steps=4)
        got = _train(streamed, xc, y, steps=4)
        torch.cuda.synchronize()
    assert want[-1] < want[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=tol.rtol, atol=tol.atol)
    for key, value in resident.state_dict().items():
        torch.testing.assert_close(
            streamed.state_dict()[key].cpu(), value.cpu(), rtol=tol.rtol, atol=tol.atol, msg=key
        )
    assert streamer.copy_seconds() > 0  # the streamed weights were copied, on the side stream


def test_measured_workspace_is_cublas_own():
    """What ``plan_offload(workspace=)`` takes: a real allocation, the same when measured again,
    between 1 MiB and 64 MiB (cuBLAS's workspaces are 4 to 32 MiB by GPU and version)."""
    from placement.runtime.torch.streaming import free_workspaces, measure_workspace

    if not free_workspaces():
        pytest.skip("this torch cannot free cuBLAS's workspaces, so none can be measured")
    first = measure_workspace("cuda:0", dtype=torch.float32)
    again = measure_workspace("cuda:0", dtype=torch.float32)
    assert 2**20 <= first <= 2**26, first
    assert again == first
