"""The exporter's extra rules: the grouped-matmul translation and the exportable-settings table."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

import placement as pl
from placement.graph.export_rules import EXPORTABLE_SETTINGS, exportable_settings, translation_table

TOL = {"rtol": 1e-5, "atol": 1e-6}


class GroupedLinear(torch.nn.Module):
    """Rows sorted by group go through their group's weight (Hugging Face's grouped-matmul op:
    ``torch._grouped_mm`` itself exports only in bfloat16, which ONNX Runtime's CPU MatMul lacks)."""

    def __init__(self, groups: int = 3, k: int = 4, n: int = 5) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(groups, k, n))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch.ops.transformers.grouped_mm_fallback(x, self.weight, offs)


def _reference(net: GroupedLinear, x: torch.Tensor, counts: torch.Tensor) -> np.ndarray:
    parts, start = [], 0
    for g, count in enumerate(counts.tolist()):
        parts.append(x[start : start + count] @ net.weight[g])
        start += count
    return torch.cat(parts).detach().numpy()


@pytest.fixture(autouse=False)
def hf_ops() -> None:
    pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback


def test_grouped_mm_is_translated_one_matmul_per_group(hf_ops: None) -> None:
    table = translation_table()
    assert torch.ops.aten._grouped_mm.default in table
    assert torch.ops.transformers.grouped_mm_fallback.default in table
    torch.manual_seed(0)
    net = GroupedLinear()
    x, counts = torch.randn(7, 4), torch.tensor([3, 0, 4])
    model = pl.from_torch(net, (x, counts), exporter="dynamo")
    matmuls = [op for op in model.ops if op.op_type == "MatMul"]
    assert sorted(op.scope for op in matmuls) == ["0", "1", "2"]  # the root module's experts: "<g>"
    for other in ([2, 2, 3], [0, 0, 7], [7, 0, 0]):  # the group sizes are data, not baked in
        counts = torch.tensor(other)
        np.testing.assert_allclose(
            pl.run(model, [x.numpy(), counts.numpy()])[0], _reference(net, x, counts), **TOL
        )
        with torch.no_grad():
            lowered = pl.to_torch(model)(x, counts)
        np.testing.assert_allclose(lowered.numpy(), _reference(net, x, counts), **TOL)


def test_groups_placed_on_different_devices(hf_ops: None) -> None:
    torch.manual_seed(0)
    net = GroupedLinear()
    x, counts = torch.randn(7, 4), torch.tensor([2, 4, 1])
    model = pl.from_torch(net, (x, counts), exporter="dynamo")
    pl.assign_modules(model, {"1": 1, "2": 2})
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    assert {str(op.device) for op in model.ops if op.op_type == "MatMul"} == {"cuda:0", "cuda:1", "cuda:2"}
    np.testing.assert_allclose(
        pl.run(model, [x.numpy(), counts.numpy()])[0], _reference(net, x, counts), **TOL
    )


SEEN: dict[int, list[str]] = {}  # per module: the implementations its forward ran with


def _record(net: FakeMoE, implementation: str) -> None:
    SEEN.setdefault(net.key, []).append(implementation)


class FakeMoE(torch.nn.Module):
    """A module with Hugging Face's experts-implementation API (and a config shared by its parts)."""

    def __init__(self, implementation: str, *, fail: bool = False, locked: bool = False) -> None:
        super().__init__()
        self.implementation = implementation
        self.key = id(self)  # torch.export undoes changes to module attributes: record outside
        SEEN[self.key] = []
        self.fail = fail
        self.locked = locked
        self.linear = torch.nn.Linear(2, 2)

    @property
    def seen(self) -> list[str]:
        return SEEN[self.key]

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return True

    def get_experts_implementation(self) -> dict[str, str]:
        return {"": self.implementation}

    def set_experts_implementation(self, value: Any) -> None:
        if self.locked:
            raise RuntimeError("a load-time choice")
        self.implementation = value[""] if isinstance(value, dict) else value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _record(self, self.implementation)
        if self.fail:
            raise RuntimeError("boom")
        return self.linear(x)


def test_a_non_exportable_setting_is_switched_for_the_export_and_restored(caplog: Any) -> None:
    net = FakeMoE("eager")
    with caplog.at_level(logging.WARNING, logger="placement.graph.export_rules"):
        pl.from_torch(net, (torch.randn(1, 2),), exporter="dynamo")
    assert set(net.seen) == {"grouped_mm"}
    assert net.implementation == "eager"
    notices = [r.getMessage() for r in caplog.records if "experts_implementation" in r.getMessage()]
    assert len(notices) == 1 and "'eager'" in notices[0] and "'grouped_mm'" in notices[0]


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_an_exportable_setting_is_left_alone(implementation: str) -> None:
    net = FakeMoE(implementation)
    with exportable_settings(net) as changed:
        assert changed == [] and net.implementation == implementation


def test_the_replacement_depends_on_the_exporter() -> None:
    net = FakeMoE("grouped_mm")
    with exportable_settings(net, "torchscript") as changed:
        assert net.implementation == "batched_mm"
        assert changed == ["FakeMoE: experts_implementation {'': 'grouped_mm'} -> 'batched_mm'"]
    assert net.implementation == "grouped_mm"


def test_the_setting_is_restored_when_the_export_fails() -> None:
    net = FakeMoE("sonicmoe", fail=True)
    with pytest.raises(pl.ExportError, match="boom"):
        pl.from_torch(net, (torch.randn(1, 2),))
    assert set(net.seen) == {"grouped_mm", "batched_mm"}  # dynamo's replacement, then TorchScript's
    assert net.implementation == "sonicmoe"


def test_the_table_names_each_setting_once() -> None:
    names = [s.name for s in EXPORTABLE_SETTINGS]
    assert len(names) == len(set(names)) and "experts_implementation" in names


def test_a_setting_the_library_refuses_to_switch_is_exported_as_configured(caplog: Any) -> None:
    net = FakeMoE("deepgemm_megamoe", locked=True)
    with caplog.at_level(logging.WARNING, logger="placement.graph.export_rules"):
        model = pl.from_torch(net, (torch.randn(1, 2),), exporter="dynamo")
    assert set(net.seen) == {"deepgemm_megamoe"} and net.implementation == "deepgemm_megamoe"
    assert any("load-time choice" in r.getMessage() for r in caplog.records)
    assert [op.op_type for op in model.ops] == ["Gemm"]


def test_other_grouped_matmul_modes_are_refused_not_mistranslated() -> None:
    class Batched(torch.nn.Module):  # (G, M, K) x (G, K, N): no offsets, not the MoE form
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(a, b)

    a = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    b = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(pl.ExportError, match="grouped_mm: only"):
        pl.from_torch(Batched(), (a, b), exporter="dynamo")


@pytest.mark.parametrize("low,high", [(0.0, 3.0), (0.0, 0.0), (1.0, 2.0)])
def test_histc_exports_and_counts_like_torch(low, high):
    """``aten.histc`` (the experts' token counts) exports through its translation whatever the
    exporter's own library has; ORT counts as torch does, the range's ends and the data's range
    (``min == max``) included."""

    class Count(torch.nn.Module):
        def forward(self, ids):
            return torch.histc(ids.float(), bins=4, min=low, max=high)

    ids = torch.tensor([[0, 3, 3, 1], [2, 2, 3, 0]])
    model = pl.from_torch(Count(), (ids,))
    (got,) = pl.run(model, [ids.numpy()], device_map="cpu")
    np.testing.assert_array_equal(got, Count()(ids).numpy())


class Strided(torch.nn.Module):
    """``x.as_strided`` after an op (ONNX tensors are row-major: the view reads ``x`` flattened)."""

    def __init__(self, size: list[int], stride: list[int], offset: int = 0) -> None:
        super().__init__()
        self.size, self.stride, self.offset = size, stride, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).as_strided(self.size, self.stride, self.offset) + 1


@pytest.mark.parametrize(
    ("size", "stride", "offset", "op_type"),
    [
        ([1, 24, 1, 1], [24, 1, 24, 24], 0, "Reshape"),  # pooling's view: strides of size-1 dims vary
        ([6, 4], [4, 1], 0, "Reshape"),
        ([2, 4], [4, 1], 8, "Slice"),  # consecutive elements past an offset
        ([3, 3], [1, 2], 1, "Gather"),  # overlapping windows
        ([4, 6], [1, 4], 0, "Gather"),  # a transposed read
    ],
)
def test_as_strided_exports_without_a_loop(size, stride, offset, op_type) -> None:
    """``aten.as_strided`` with static sizes is a Reshape, Slice or Gather of constant flat indices,
    never onnxscript's ``SequenceEmpty``/``Loop``, and both runtimes compute what torch does."""
    assert torch.ops.aten.as_strided.default in translation_table()
    net = Strided(size, stride, offset)
    x = torch.randn(1, 24, 1, 1) if size[1] == 24 else torch.randn(4, 6)
    model = pl.from_torch(net, (x,), exporter="dynamo")
    ops = {op.op_type for op in model.ops}
    assert op_type in ops and not ops & {"Loop", "SequenceEmpty"}, ops
    expected = net(x).numpy()
    np.testing.assert_array_equal(pl.run(model, [x.numpy()])[0], expected)
    with torch.no_grad():
        np.testing.assert_array_equal(pl.to_torch(model)(x).numpy(), expected)
