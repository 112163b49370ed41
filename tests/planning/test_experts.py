"""spread_experts / expert_modules on a grouped matmul (the op Hugging Face's MoE layers export)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from placement.models import mlp
from placement.planning.experts import expert_modules

pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback


class Experts(torch.nn.Module):
    """One experts module: expert ``g`` is ``up[g]``, ReLU, ``down[g]`` on its ``counts[g]`` rows."""

    def __init__(self, experts: int = 3, width: int = 4) -> None:
        super().__init__()
        self.up = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.randn(experts, width, 2 * width))})
        self.down = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.randn(experts, 2 * width, width))})

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch.ops.transformers.grouped_mm_fallback(x, self.up["w"], offs).relu()
        return torch.ops.transformers.grouped_mm_fallback(h, self.down["w"], offs)


@pytest.fixture(scope="module")
def imported() -> tuple[pl.Model, list[np.ndarray], np.ndarray]:
    torch.manual_seed(0)
    net = Experts()
    x, counts = torch.randn(6, 4), torch.tensor([2, 3, 1])
    expected = np.concatenate(
        [
            (x[s:e] @ net.up["w"][g]).relu().__matmul__(net.down["w"][g]).detach().numpy()
            for g, (s, e) in enumerate([(0, 2), (2, 5), (5, 6)])
        ]
    )
    return pl.from_torch(net, (x, counts), exporter="dynamo"), [x.numpy(), counts.numpy()], expected


def test_expert_modules_lists_each_experts_module(imported) -> None:
    model, inputs, expected = imported
    found = expert_modules(model)
    assert len(found) == 1  # both grouped matmuls are the root module's: expert g is both its MatMuls
    assert found[""] == ["0", "1", "2"]
    np.testing.assert_allclose(pl.run(model, inputs)[0], expected, rtol=1e-5, atol=1e-5)


def test_spread_experts_moves_only_the_experts(imported) -> None:
    model, inputs, expected = imported
    model = model.copy()
    others = {op.name: op.device for op in model.ops if op.scope not in {"0", "1", "2"}}
    spread = pl.spread_experts(model, [0, 1])
    assert {k: str(v) for k, v in spread.items()} == {"0": "cuda:0", "1": "cuda:1", "2": "cuda:0"}
    assert {op.device.index for op in model.ops if op.op_type == "MatMul" and op.scope == "1"} == {1}
    assert {op.name: op.device for op in model.ops if op.name in others} == others
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    np.testing.assert_allclose(pl.run(model, inputs)[0], expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        lowered = pl.to_torch(model)(*[torch.from_numpy(a) for a in inputs])
    np.testing.assert_allclose(lowered.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_spread_experts_errors(imported) -> None:
    model = imported[0].copy()
    state = model.device_state()
    with pytest.raises(pl.PlanError, match="non-empty"):
        pl.spread_experts(model, [])
    with pytest.raises(pl.DeviceError, match="spread_experts"):
        pl.spread_experts(model, [0, "tpu:x"])
    with pytest.raises(pl.PlanError, match="'layers.0' is not an experts module"):
        pl.spread_experts(model, [0, 1], modules=["layers.0"])
    assert model.device_state() == state
    with pytest.raises(pl.PlanError, match="no experts"):
        pl.spread_experts(pl.from_torch(*mlp.build("tiny")), [0, 1])
