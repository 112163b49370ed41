"""``auto_place(model, devices=N, tensor_parallel=k)`` with ``1 < k < N``: pipeline stages, each
split over its own group of devices (tensor inside pipeline, 2D), planned and applied."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from placement.graph.nodes import DEVICE_KEY, collective_tag
from placement.models import gpt, mlp
from placement.planning.dims import planned_dims
from placement.planning.graph_info import GraphInfo
from placement.planning.link_model import Links
from placement.planning.plan import tp_headline
from placement.planning.tp_cost import analyse_split
from placement.planning.tp_planner import layouts, objective_ns
from tests.passes.test_tensor_parallel_2d import _shard_grads_match

TOL = {"rtol": 1e-5, "atol": 1e-5}
#: FLOP/s of one (emulated) device, given so that plans do not depend on this machine's speed.
SPEED = {"cuda": 2e10}
FLOPS = {"cost": "flops", "throughput": SPEED}
BATCH = ({0: torch.export.Dim("batch")},)  # a dynamic batch: micro-batches pipeline


@pytest.fixture(scope="module")
def tiny_gpt():
    net, (idx,) = gpt.build("tiny")
    idx = torch.cat([idx, idx.flip(0)], 0)  # 4 sequences: 2 micro-batches of 2
    return net, idx, pl.from_torch(net, (idx,), dynamic_shapes=BATCH)


def _check_groups(model: pl.Model, plan: pl.Plan) -> None:
    """Every collective stays inside one of the plan's groups, on a device of that group."""
    pl.verify(model)
    assert sorted(str(d) for d in model.devices) == sorted(d for g in plan.groups for d in g)
    tags = [(n, collective_tag(n)) for n in model.graph if collective_tag(n) is not None]
    assert tags and {tuple(t["group"]) for _, t in tags} == {tuple(g) for g in plan.groups}
    for node, tag in tags:
        assert node.metadata_props[DEVICE_KEY] in tag["group"]


@pytest.fixture(scope="module")
def placed_gpt(tiny_gpt):
    """The tiny GPT planned and split with tensor_parallel=2 on 4 devices, and its reference logits."""
    net, idx, original = tiny_gpt
    model = original.copy()
    plan = pl.auto_place(model, devices=4, tensor_parallel=2, **FLOPS)
    with torch.no_grad():
        expected = net(idx).numpy()
    return net, idx, model, plan, expected


def test_a_degree_inside_a_pipeline_makes_two_split_stages(placed_gpt):
    """tensor_parallel=2 on 4 devices: 2 stages on [0, 1] and [2, 3], collectives inside them;
    ORT pipelined and one ORT session give the unsplit model's outputs."""
    _, idx, model, plan, expected = placed_gpt
    assert plan.tensor_parallel == [2, 2] and not plan.tp_choices
    assert plan.groups == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert [r.device for r in plan.devices] == plan.groups[0] + plan.groups[1]
    assert [r.degree for r in plan.devices] == [2] * 4 and all(r.ops for r in plan.devices)
    assert sum(r.collective_time for r in plan.devices[::2]) == plan.collective_time
    assert "stage groups cuda:0,cuda:1 | cuda:2,cuda:3" in tp_headline(plan)
    assert pl.Plan.from_json(plan.to_json()) == plan
    (p,) = pl.predict(plan, chunks=2)
    assert p.extra["groups"] == plan.groups and p.extra["devices"] == ["cuda:0", "cuda:2"]
    _check_groups(model, plan)
    np.testing.assert_allclose(pl.Runner(model, chunks=2).run([idx])[0], expected, **TOL)
    np.testing.assert_allclose(pl.Runner(model, device_map="cpu").run([idx])[0], expected, **TOL)


def test_to_torch_and_its_train_step_through_the_2d_plan(placed_gpt):
    """to_torch pipelined and its 1F1B train step give the unsplit outputs, loss and gradients."""
    net, idx, model, _, expected = placed_gpt
    lowered = pl.to_torch(model, chunks=2)
    np.testing.assert_allclose(lowered(idx).detach().numpy(), expected, **TOL)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    loss = lowered.train_step(idx, loss_fn=loss_fn)
    net.zero_grad()
    reference = loss_fn(net(idx))
    reference.backward()
    torch.testing.assert_close(loss.detach(), reference.detach(), **TOL)
    _shard_grads_match(net, lowered)


def test_a_saved_2d_plan_applies_to_a_fresh_export(tiny_gpt, tmp_path):
    net, idx, original = tiny_gpt
    plan = pl.auto_place(original.copy(), devices=4, tensor_parallel=2, **FLOPS)
    plan.save(tmp_path / "plan.json")
    model = original.copy()
    pl.Plan.load(tmp_path / "plan.json").apply(model)
    _check_groups(model, plan)
    (out,) = pl.Runner(model, chunks=2).run([idx])
    np.testing.assert_allclose(out, net(idx).detach().numpy(), **TOL)


def test_the_mlp_splits_inside_a_pipeline():
    net, (x,) = mlp.build("tiny")
    model = pl.from_torch(net, (x,), dynamic_shapes=BATCH)
    plan = pl.auto_place(model, devices=4, tensor_parallel=2, **FLOPS)
    assert plan.groups == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]] and plan.tensor_parallel == [2, 2]
    _check_groups(model, plan)
    with torch.no_grad():
        expected = net(x).numpy()
    np.testing.assert_allclose(pl.Runner(model, chunks=2).run([x])[0], expected, **TOL)
    np.testing.assert_allclose(pl.to_torch(model, chunks=2)(x).detach().numpy(), expected, **TOL)


def test_auto_weighs_every_divisor_and_keeps_the_cheapest(tiny_gpt):
    """Each degree's score is what ``auto_place`` with that degree predicts; the choice is the
    smallest score for the objective, whatever it is."""
    net, idx, original = tiny_gpt
    for objective in ("throughput", "latency"):
        model = original.copy()
        plan = pl.auto_place(model, devices=4, tensor_parallel="auto", objective=objective, **FLOPS)
        assert sorted(plan.tp_choices) == ["1", "2", "4"]
        for degree, score in plan.tp_choices.items():
            alone = pl.auto_place(
                original.copy(), devices=4, tensor_parallel=int(degree), objective=objective, **FLOPS
            )
            assert objective_ns(alone, objective) == score
        best = min(plan.tp_choices, key=lambda t: (plan.tp_choices[t], int(t)))
        assert set(plan.tensor_parallel) == {int(best)}
        assert objective_ns(plan, objective) == plan.tp_choices[best]
        (out,) = pl.Runner(model, device_map={d: "cpu" for d in model.devices}, fold=False).run([idx])
        np.testing.assert_allclose(out, net(idx).detach().numpy(), **TOL)


def test_auto_picks_2d_when_no_pipeline_fits_and_collectives_favour_fewer_devices():
    """An MLP whose first linear (64 x 2048, 512 KiB) is bigger than a device's 400 KiB: no
    pipeline of unsplit stages fits, so degree 1 is out. Degrees 2 and 4 both fit; for a stream
    of batches (throughput) each 2D stage runs half the layers at degree 2, and so half the
    collectives with one copy into each device, where degree 4 runs every collective with 3
    copies into each device. The cost model's numbers say so, and auto keeps 2 x 2."""
    torch.manual_seed(0)
    net = mlp.MLP((64, 2048, 8, 2048, 8)).eval()
    x = torch.randn(4, 64)
    model = pl.from_torch(net, (x,), dynamic_shapes=BATCH)
    budgets = {k: "400KiB" for k in range(4)}
    with pytest.raises(pl.InfeasiblePlacementError):
        pl.auto_place(model.copy(), devices=4, max_memory=budgets, tensor_parallel=1, links="nvlink", **FLOPS)
    plan = pl.auto_place(model, max_memory=budgets, tensor_parallel="auto", links="nvlink", **FLOPS)
    assert sorted(plan.tp_choices) == ["2", "4"] and plan.tp_choices["2"] < plan.tp_choices["4"]
    assert plan.tensor_parallel == [2, 2] and plan.fits
    assert max(r.collective_time for r in plan.devices) < plan.tp_choices["4"]
    _check_groups(model, plan)
    (out,) = pl.Runner(model, chunks=2).run([x])
    np.testing.assert_allclose(out, net(x).detach().numpy(), **TOL)


def test_links_choose_the_groups(tiny_gpt):
    """NVLink between 0-2 and 1-3, PCIe elsewhere: the strided groups [0, 2], [1, 3] make each
    collective cheaper than the consecutive ones (the cost model prices both), so the plan
    splits over them; the copy between the stages crosses PCIe either way."""
    net, idx, original = tiny_gpt
    links = Links({(0, 2): "nvlink", (1, 3): "nvlink"}, default="pcie")
    gpus = [pl.Device("cuda", k) for k in range(4)]
    blocked, strided = layouts(gpus, 2, links)
    dims = planned_dims(original, batch=4)
    split = analyse_split(original, GraphInfo(original, dims=dims), blocked[0], links=links, dims=dims)
    for fast, slow in zip(strided, blocked):
        assert sum(c.time_ns for c in split.on(fast, links).collectives) < sum(
            c.time_ns for c in split.on(slow, links).collectives
        )
    model = original.copy()
    plan = pl.auto_place(model, devices=4, tensor_parallel=2, links=links, **FLOPS)
    assert plan.groups == [["cuda:0", "cuda:2"], ["cuda:1", "cuda:3"]]
    _check_groups(model, plan)
    (out,) = pl.Runner(model, chunks=2).run([idx])
    np.testing.assert_allclose(out, net(idx).detach().numpy(), **TOL)


def test_predict_reports_the_degree_and_the_groups(tiny_gpt):
    """A stream (chunks > 1): the planner's 2D plan, its groups and collectives per stage."""
    _, _, original = tiny_gpt
    (p,) = pl.predict(original, gpus=4, tensor_parallel=2, chunks=4, throughput={"cuda": 1e11})
    assert p.extra["tensor_parallel"] == [2, 2]
    assert p.extra["groups"] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert p.extra["devices"] == ["cuda:0", "cuda:2"] and all(c > 0 for c in p.extra["collective_s"])
    assert [str(d) for d in original.devices] == ["cuda:0"]  # predictions leave the model unplaced


def test_a_plan_with_groups_of_different_sizes_is_refused(tiny_gpt):
    _, _, original = tiny_gpt
    plan = pl.auto_place(original.copy(), devices=4, tensor_parallel=2, **FLOPS)
    plan.groups = [["cuda:0", "cuda:1"], ["cuda:2"]]
    model = original.copy()
    with pytest.raises(pl.InputError, match="not all of one size"):
        plan.apply(model)
    assert [str(d) for d in model.devices] == ["cuda:0"] and not any(op.is_copy for op in model.ops)
