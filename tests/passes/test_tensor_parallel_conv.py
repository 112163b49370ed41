"""Grouped and depthwise convolutions split by whole groups, whatever their input's layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import placement as pl
from placement.errors import InputError
from placement.graph.nodes import collective_tag

TOL = {"rtol": 1e-5, "atol": 1e-5}


class _MobileNetish(nn.Module):
    """A grouped conv fed by the graph input, a depthwise conv on a whole (all-reduced) input,
    a MobileNet block (1x1 expand, depthwise 3x3, 1x1 project) with a residual, and a conv of
    2 groups."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 8, 3, padding=1, groups=4)
        self.bn0 = nn.BatchNorm2d(8)
        self.mix = nn.Conv2d(8, 10, 1)
        self.dw = nn.Conv2d(10, 10, 3, padding=1, groups=10)
        self.bn1 = nn.BatchNorm2d(10)
        self.project = nn.Conv2d(10, 12, 1)
        self.expand = nn.Conv2d(12, 24, 1)
        self.dw2 = nn.Conv2d(24, 24, 3, padding=1, groups=24)
        self.bn2 = nn.BatchNorm2d(24)
        self.shrink = nn.Conv2d(24, 12, 1)
        self.pair = nn.Conv2d(12, 8, 3, padding=1, groups=2)
        self.head = nn.Linear(8, 5)
        for bn in (self.bn0, self.bn1, self.bn2):  # distinct values in every channel
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.normal_()
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn0(self.stem(x)))
        h = F.relu6(self.bn1(self.dw(self.mix(h))))
        h = self.project(h)
        r = F.relu6(self.bn2(self.dw2(torch.relu(self.expand(h)))))
        h = torch.relu(self.pair(h + self.shrink(r)))
        return self.head(h.mean((2, 3)))


#: per degree, each device's number of groups of stem (4), dw (10), dw2 (24) and pair (2)
GROUPS = {
    2: {"stem": [2, 2], "dw": [5, 5], "dw2": [12, 12], "pair": [1, 1]},
    3: {"stem": [2, 1, 1], "dw": [4, 3, 3], "dw2": [8, 8, 8], "pair": [1, 1, 1]},
}


def _built() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _MobileNetish().eval(), torch.randn(2, 4, 6, 6)


def _collectives(model: pl.Model) -> dict[str, int]:
    ids: dict[str, set[int]] = {}
    for node in model.graph:
        tag = collective_tag(node)
        if tag is not None:
            ids.setdefault(tag["kind"], set()).add(tag["id"])
    return {kind: len(found) for kind, found in ids.items()}


def _conv_groups(model: pl.Model) -> dict[str, list[int]]:
    """Per original conv, each device's ``group`` in device order."""
    found: dict[str, list[int]] = {}
    for node in model.graph:
        if node.op_type == "Conv":
            scope = pl.Op(node).scope or ""
            group = node.attributes.get("group")
            found.setdefault(scope.split(".")[-1], []).append(1 if group is None else group.value)
    return found


@pytest.mark.parametrize("degree", [2, 3])
def test_grouped_convs_split_by_groups_and_equal_the_unsplit_model(degree: int) -> None:
    net, x = _built()
    model = pl.from_torch(net, (x,))
    with torch.no_grad():
        expected = net(x).numpy()
    result = pl.split_tensor_parallel(model, devices=list(range(degree)))
    pl.verify(model)
    groups = _conv_groups(model)
    for name, per_device in GROUPS[degree].items():
        assert groups[name] == per_device, name  # no grouped conv runs whole, replicated
    # one all-reduce after each row-parallel op (mix, project, shrink, head); no all-gather:
    # the grouped convs on whole inputs slice them, their outputs stay sharded
    assert _collectives(model) == {"all_reduce": 4}
    assert result.all_reduces == 4 and result.all_gathers == 0
    sliced = {n.inputs[0].name for n in model.graph if n.op_type == "Slice"}
    assert "x" in sliced  # each device slices its groups of the graph input, a local op
    runner = pl.Runner(model, device_map={d: "cpu" for d in range(degree)}, fold=False)
    np.testing.assert_allclose(runner.run([x.numpy()])[0], expected, **TOL)
    lowered = pl.to_torch(model)
    xs, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = lowered(xl)
    np.testing.assert_allclose(out.detach().numpy(), expected, **TOL)
    net.zero_grad()
    net(xs).square().mean().backward()
    out.square().mean().backward()
    torch.testing.assert_close(xl.grad, xs.grad, **TOL)
    _shard_grads_match(net, lowered)


def _shard_grads_match(net: nn.Module, lowered: nn.Module) -> None:
    """Each lowered parameter's gradient equals the unsplit one at the elements it holds, and
    the shards of a parameter cover it."""
    orig = dict(net.named_parameters())
    params = dict(lowered.named_parameters())
    covered: dict[str, set[tuple[int, int]]] = {}
    for init, path in lowered.initializer_paths.items():
        base, p = init.split(".tp")[0].removesuffix(".after_reduce"), params.get(path)
        if p is None or base not in orig:
            continue
        whole = orig[base]
        assert p.grad is not None, init
        if p.numel() == whole.numel():  # whole (a bias added after an all-reduce: reshaped)
            torch.testing.assert_close(p.grad.reshape(whole.shape), whole.grad, **TOL)
            covered[base] = {(0, j) for j in range(whole.shape[0])}
            continue
        (axis,) = [a for a in range(p.dim()) if p.shape[a] != whole.shape[a]]
        index = [
            next(j for j in range(whole.shape[axis]) if torch.equal(whole.detach().select(axis, j), row))
            for row in p.detach().unbind(axis)
        ]
        torch.testing.assert_close(p.grad, whole.grad.index_select(axis, torch.tensor(index)), **TOL)
        covered.setdefault(base, set()).update((axis, j) for j in index)
    assert covered.keys() == orig.keys()
    for base, seen in covered.items():
        (axis,) = {a for a, _ in seen}
        assert {j for _, j in seen} == set(range(orig[base].shape[axis])), base


def test_a_group_with_fewer_output_channels_than_its_devices_runs_whole() -> None:
    torch.manual_seed(0)
    pair, x = nn.Conv2d(4, 2, 3, groups=2).eval(), torch.randn(1, 4, 5, 5)
    model = pl.from_torch(pair, (x,))
    before = model.copy()
    with pytest.raises(InputError, match="no op could be split"):  # 2 groups of 1 channel on 3 devices
        pl.split_tensor_parallel(model, devices=[0, 1, 2])
    assert [op.device for op in model.ops] == [op.device for op in before.ops]
    assert model.parameters.keys() == before.parameters.keys()
    net = nn.Sequential(pair, nn.ReLU(), nn.Conv2d(2, 6, 1)).eval()
    model = pl.from_torch(net, (x,))
    pl.split_tensor_parallel(model, devices=[0, 1, 2])
    assert _conv_groups(model)["0"] == [2, 2, 2]  # whole on every device; the 1x1 conv after splits
    runner = pl.Runner(model, device_map={d: "cpu" for d in range(3)}, fold=False)
    with torch.no_grad():
        np.testing.assert_allclose(runner.run([x.numpy()])[0], net(x).numpy(), **TOL)


def test_a_shard_that_cuts_groups_is_gathered_then_split_by_groups() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 1), nn.ReLU(), nn.Conv2d(6, 9, 3, groups=3), nn.ReLU(), nn.Conv2d(9, 4, 1)
    ).eval()
    x = torch.randn(2, 3, 6, 6)
    model = pl.from_torch(net, (x,))
    # 6 channels on 4 devices are 2, 2, 1, 1: devices 2 and 3 hold half a group each
    result = pl.split_tensor_parallel(model, devices=[0, 1, 2, 3])
    pl.verify(model)
    assert (result.all_gathers, result.all_reduces) == (1, 1)
    assert _collectives(model) == {"all_gather": 1, "all_reduce": 1}  # device 0 needs no gathered copy
    # 3 groups on 4 devices: group 0 on devices 0 and 1 (3 output channels: 2 and 1), one each after
    assert _conv_groups(model)["2"] == [1, 1, 1, 1]
    shapes = [n.inputs[1].shape[0] for n in model.graph if n.op_type == "Conv" and pl.Op(n).scope == "2"]
    assert shapes == [2, 1, 3, 3]
    runner = pl.Runner(model, device_map={d: "cpu" for d in range(4)}, fold=False)
    with torch.no_grad():
        np.testing.assert_allclose(runner.run([x.numpy()])[0], net(x).numpy(), **TOL)
