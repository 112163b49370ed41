"""Tensor inside pipeline (2D): split_tensor_parallel over one group per pipeline stage."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import placement as pl
from placement.errors import InputError
from placement.graph.nodes import DEVICE_KEY, collective_tag
from placement.models import gpt

TOL = {"rtol": 1e-5, "atol": 1e-5}
GROUPS = [[0, 1], [2, 3]]


def _pipelined(net: nn.Module, idx: torch.Tensor) -> pl.Model:
    """The tiny GPT as two pipeline stages, on devices 0 and 2, with copies."""
    model = pl.from_torch(net, (idx,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 2})
    pl.inject_cross_device_copies(model)
    return model


@pytest.fixture(scope="module")
def gpt_2d() -> tuple[nn.Module, torch.Tensor, pl.Model, np.ndarray]:
    net, (idx,) = gpt.build("tiny")
    idx = torch.cat([idx, idx.flip(0)], 0)  # 2 sequences or more: micro-batches
    model = _pipelined(net, idx)
    pl.split_tensor_parallel(model, devices=GROUPS)
    with torch.no_grad():
        expected = net(idx).numpy()
    return net, idx, model, expected


def test_each_stage_splits_over_its_group_with_collectives_inside_it(gpt_2d) -> None:
    _, _, model, _ = gpt_2d
    pl.verify(model)
    assert sorted(str(d) for d in model.devices) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    groups = {tuple(f"cuda:{d}" for d in g) for g in GROUPS}
    tags = [(n, collective_tag(n)) for n in model.graph if collective_tag(n) is not None]
    assert tags
    for node, tag in tags:
        assert tuple(tag["group"]) in groups and node.metadata_props[DEVICE_KEY] in tag["group"]
    # every copy across the stage boundary: device k of the second group reads device k of the first
    first, second = [f"cuda:{d}" for d in GROUPS[0]], [f"cuda:{d}" for d in GROUPS[1]]
    sources: dict[str, set[str]] = {}
    producer = {out: str(op.device) for op in model.ops for out in op.outputs}
    acts = set(pl.get_activation_blobs(model))
    for op in model.ops:
        if (
            op.is_copy
            and op.inputs[0] in acts
            and str(op.device) in second
            and producer.get(op.inputs[0]) in first
        ):
            sources.setdefault(str(op.device), set()).add(producer[op.inputs[0]])
    assert sources == {second[k]: {first[k]} for k in range(2)}


def test_outputs_equal_the_unsplit_model(gpt_2d) -> None:
    _, idx, model, expected = gpt_2d
    out = pl.run(model, {"idx": idx.numpy()})[0]
    np.testing.assert_allclose(out, expected, **TOL)
    runner = pl.Runner(model, chunks=2)
    np.testing.assert_allclose(runner.run({"idx": idx.numpy()})[0], expected, **TOL)


def _shard_grads_match(net: nn.Module, lowered: nn.Module) -> None:
    """Each lowered parameter's gradient equals the unsplit one at the elements it holds."""
    orig = dict(net.named_parameters(remove_duplicate=False))
    params = dict(lowered.named_parameters())
    covered: dict[str, set[tuple[int, int]]] = {}
    checked = 0
    for init, path in lowered.initializer_paths.items():
        p = params.get(path)
        base = init.split(".tp")[0]
        if p is None or base not in orig:
            continue
        assert p.grad is not None, init
        whole = orig[base]
        checked += 1
        if p.shape == whole.shape:
            torch.testing.assert_close(p.grad, whole.grad, **TOL)
            continue
        (axis,) = [a for a in range(p.dim()) if p.shape[a] != whole.shape[a]]
        rows = [whole.detach().select(axis, j) for j in range(whole.shape[axis])]
        index = [
            next(j for j, r in enumerate(rows) if torch.equal(r, p.detach().select(axis, i)))
            for i in range(p.shape[axis])
        ]
        torch.testing.assert_close(p.grad, whole.grad.index_select(axis, torch.tensor(index)), **TOL)
        covered.setdefault(base, set()).update((axis, j) for j in index)
    assert checked
    for base, seen in covered.items():
        axis = next(iter(seen))[0]
        assert {j for _, j in seen} == set(range(orig[base].shape[axis])), base


@pytest.mark.parametrize("chunks", [1, 2])
def test_to_torch_forward_and_gradients_equal_the_unsplit_model(gpt_2d, chunks: int) -> None:
    net, idx, model, expected = gpt_2d
    lowered = pl.to_torch(model, chunks=chunks) if chunks > 1 else pl.to_torch(model)
    out = lowered(idx)
    np.testing.assert_allclose(out.detach().numpy(), expected, **TOL)
    net.zero_grad()
    net(idx).square().mean().backward()
    out.square().mean().backward()
    _shard_grads_match(net, lowered)


def test_groups_are_checked_and_the_model_is_left_unchanged() -> None:
    net, (idx,) = gpt.build("tiny")
    model = _pipelined(net, idx)
    before = model.copy()
    for devices, word in (
        ([[0, 1], [1, 3]], "disjoint"),
        ([[0, 1], [2, 3, 4]], "one size"),
        ([[0, 1], [3, 4]], "none of"),
    ):
        with pytest.raises(InputError, match=word):
            pl.split_tensor_parallel(model, devices=devices)
    assert [op.device for op in model.ops] == [op.device for op in before.ops]
    assert model.parameters.keys() == before.parameters.keys()


def test_train_step_gives_the_unsplit_gradients(gpt_2d) -> None:
    net, idx, model, _ = gpt_2d
    lowered = pl.to_torch(model, chunks=2)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    loss = lowered.train_step(idx, loss_fn=loss_fn)
    net.zero_grad()
    expected = loss_fn(net(idx))
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), **TOL)
    _shard_grads_match(net, lowered)
