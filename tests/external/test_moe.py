"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE) as configured by default.

Their default experts implementation (``"grouped_mm"``) calls a custom grouped-matmul op
that ``pl.from_torch`` translates to one MatMul per expert; ``"eager"`` cannot be exported
and is switched for the export and restored. Each model is built from a tiny config
(random weights, nothing downloaded), imported, placed over two logical devices (by the
planner, and with the experts of one layer spread over both) and must compute what the
``transformers`` module computes, in both runtimes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import placement as pl
from placement.graph.torch_import import exporter_of

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-4, "atol": 1e-5}
SMALL = {
    "num_hidden_layers": 1,  # an export costs seconds per layer; one MoE layer shows it all
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "vocab_size": 50,
    "max_position_embeddings": 32,
    "use_cache": False,
}
EXPERTS = 4

ARCHITECTURES: dict[str, Callable[[], torch.nn.Module]] = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(num_local_experts=EXPERTS, num_experts_per_tok=2, **SMALL)
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            **SMALL,
        )
    ),
}


class Logits(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids).logits


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))


Imported = tuple[pl.Model, torch.Tensor, np.ndarray, torch.nn.Module]


@functools.cache
def _imported(name: str, implementation: str | None) -> tuple[Imported, dict[str, Any]]:
    torch.manual_seed(0)
    net = ARCHITECTURES[name]().eval()
    if implementation is not None:
        net.set_experts_implementation(implementation)
    wrapped = Logits(net).eval()
    ids = _ids()
    with torch.no_grad():
        expected = wrapped(ids).numpy()
    before = {
        "implementation": net.get_experts_implementation(),
        "state": {k: v.clone() for k, v in net.state_dict().items()},
    }
    model = pl.from_torch(wrapped, (ids,))
    return (model, ids, expected, net), before


@pytest.fixture
def imported() -> Callable[..., Imported]:
    """(a fresh copy of the imported model, its input, the module's logits, the HF module)."""

    def get(name: str, implementation: str | None = None) -> Imported:
        (model, ids, expected, net), _ = _imported(name, implementation)
        return model.copy(), ids, expected, net

    return get


def _lowered(model: pl.Model, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        out = pl.to_torch(model)(ids)
    return (out[0] if isinstance(out, (list, tuple)) else out).numpy()


def _experts_scope(model: pl.Model, layer: int) -> str:
    scopes = {op.scope for op in model.ops if op.scope and op.scope.endswith(f"layers.{layer}.mlp.experts")}
    assert len(scopes) == 1, scopes
    return scopes.pop()


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_default_configuration_imports_and_leaves_the_module_unchanged(name: str, imported: Any) -> None:
    model, ids, expected, net = imported(name)
    _, before = _imported(name, None)
    assert before["implementation"] == {"": "grouped_mm"}  # the default this test is about
    assert net.get_experts_implementation() == before["implementation"]
    assert net.config._experts_implementation == "grouped_mm"
    for key, value in net.state_dict().items():
        assert torch.equal(value, before["state"][key]), key
    assert exporter_of(model) == "dynamo"
    experts = _experts_scope(model, 0)
    per_expert = {
        op.scope for op in model.ops if op.op_type == "MatMul" and op.scope.startswith(experts + ".")
    }
    assert per_expert == {f"{experts}.{g}" for g in range(EXPERTS)}
    np.testing.assert_allclose(pl.run(model, [ids.numpy()])[0], expected, **TOL)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_auto_placed_on_two_devices_equals_the_module(name: str, imported: Any) -> None:
    model, ids, expected, _ = imported(name)
    plan = pl.auto_place(model, devices=2, cost="flops")
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    assert len({op.device for op in model.ops}) == 2, plan
    np.testing.assert_allclose(pl.run(model, [ids.numpy()])[0], expected, **TOL)
    np.testing.assert_allclose(_lowered(model, ids), expected, **TOL)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_experts_of_one_layer_on_two_devices(name: str, imported: Any) -> None:
    model, ids, expected, _ = imported(name)
    experts = _experts_scope(model, 0)
    pl.assign_modules(model, {f"{experts}.{g}": 1 for g in range(1, EXPERTS, 2)})
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    devices = {
        int(op.scope.rsplit(".", 1)[1]): op.device.index
        for op in model.ops
        if op.op_type == "MatMul" and op.scope.startswith(experts + ".")
    }
    assert devices == {g: g % 2 for g in range(EXPERTS)}
    np.testing.assert_allclose(pl.run(model, [ids.numpy()])[0], expected, **TOL)
    np.testing.assert_allclose(_lowered(model, ids), expected, **TOL)


def test_eager_experts_are_exported_as_grouped_and_restored(imported: Any) -> None:
    model, ids, expected, net = imported("mixtral", "eager")
    assert net.get_experts_implementation() == {"": "eager"}
    assert net.config._experts_implementation == "eager"
    pl.auto_place(model, devices=2, cost="flops")
    pl.inject_cross_device_copies(model)
    np.testing.assert_allclose(pl.run(model, [ids.numpy()])[0], expected, **TOL)
    np.testing.assert_allclose(_lowered(model, ids), expected, **TOL)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_layers_experts_spread_after_auto_place(name: str, imported: Any) -> None:
    model, ids, expected, _ = imported(name)
    pl.auto_place(model, devices=2, cost="flops")
    spread = pl.spread_experts(model, [0, 1])
    assert len(spread) == SMALL["num_hidden_layers"] * EXPERTS
    for layer in range(SMALL["num_hidden_layers"]):
        experts = _experts_scope(model, layer)
        assert [spread[f"{experts}.{g}"].index for g in range(EXPERTS)] == [0, 1, 0, 1]
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    np.testing.assert_allclose(pl.run(model, [ids.numpy()])[0], expected, **TOL)
    np.testing.assert_allclose(_lowered(model, ids), expected, **TOL)


class MaskedLogits(torch.nn.Module):
    """With an attention mask: transformers' packed-sequence check (``aten::diff``, which the
    TorchScript exporter lacks) runs only without one."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids, attention_mask=mask).logits


def test_the_torchscript_exporter_gets_batched_experts() -> None:
    torch.manual_seed(0)
    net = ARCHITECTURES["mixtral"]().eval()
    wrapped = MaskedLogits(net).eval()
    ids, mask = _ids(), torch.ones(2, 8, dtype=torch.long)
    with torch.no_grad():
        expected = wrapped(ids, mask).numpy()
    model = pl.from_torch(wrapped, (ids, mask), exporter="torchscript")
    assert exporter_of(model) == "torchscript"
    assert net.get_experts_implementation() == {"": "grouped_mm"}
    pl.auto_place(model, devices=2, cost="flops")
    pl.inject_cross_device_copies(model)
    np.testing.assert_allclose(pl.run(model, [ids.numpy(), mask.numpy()])[0], expected, **TOL)
    with torch.no_grad():
        lowered = pl.to_torch(model)(ids, mask)
    np.testing.assert_allclose(lowered.numpy(), expected, **TOL)
