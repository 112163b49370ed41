"""``auto_place(tensor_parallel=...)``: the degree from the cost model, applied; predictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from placement.errors import InputError, PlanError
from placement.graph.nodes import collective_tag
from placement.models import gpt
from placement.planning.tp_planner import candidate_degrees, objective_ns

#: FLOP/s of one (emulated) device: a CPU core's order, given so that the choice is exact.
SPEED = {"cuda": 2e10}


def _gpt(batch: int):
    net, _ = gpt.build("tiny")
    idx = torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(0))
    return net, idx, pl.from_torch(net, (idx,))


@pytest.fixture(scope="module")
def many_tokens():
    return _gpt(256)  # 2048 tokens per step: compute dominates


@pytest.fixture(scope="module")
def few_tokens():
    return _gpt(1)  # 8 tokens per step: the collectives' latency dominates


def _auto(model: pl.Model, **options) -> pl.Plan:
    options = {"objective": "latency", "links": "memcpy", **options}
    return pl.auto_place(model, devices=2, tensor_parallel="auto", cost="flops", throughput=SPEED, **options)


def _outputs_equal(model: pl.Model, net, idx) -> None:
    device_map = {d: "cpu" for d in model.devices}  # each logical device its own CPU session
    (out,) = pl.Runner(model, device_map=device_map, fold=False).run([idx])
    np.testing.assert_allclose(out, net(idx).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_auto_splits_when_compute_dominates(many_tokens):
    net, idx, original = many_tokens
    model = original.copy()
    plan = _auto(model)
    assert plan.tensor_parallel == [2] and plan.groups == [["cuda:0", "cuda:1"]]
    assert plan.tp_choices["2"] < plan.tp_choices["1"]
    assert plan.tp_choices["2"] == objective_ns(plan, "latency")
    # embedding, 2 per block, the gathered logits; each costs its copies and a latency
    assert plan.collectives == 6 and plan.collective_time >= 6 * 50_000
    row = plan.devices[0]
    assert plan.total_cost / 2 < row.cost < plan.total_cost  # the linears halve, norms do not
    # a Sum per device for each all-reduce; the logits are gathered on the first device only
    assert sum(collective_tag(n) is not None for n in model.graph) == 5 * 2 + 1
    pl.verify(model)
    _outputs_equal(model, net, idx)
    assert "tensor parallel 2 (chosen from 1:" in str(plan)
    assert pl.Plan.from_json(plan.to_json()) == plan


def test_auto_keeps_one_device_when_latency_bound(few_tokens):
    net, idx, original = few_tokens
    model = original.copy()
    plan = _auto(model)
    assert plan.tensor_parallel == [1] and plan.collectives == 0
    assert plan.tp_choices["1"] < plan.tp_choices["2"]
    assert not any(collective_tag(n) for n in model.graph)
    assert [str(d) for d in model.devices] == ["cuda:0"]  # one request: every stage on one device
    _outputs_equal(model, net, idx)


def test_auto_for_throughput_keeps_the_pipeline(many_tokens):
    """A stream of batches: two pipeline stages halve everything, a split halves only the linears."""
    _, _, original = many_tokens
    plan = _auto(original.copy(), objective="throughput")
    assert plan.tensor_parallel == [1, 1] and plan.tp_choices["1"] < plan.tp_choices["2"]


def test_a_given_degree_is_applied(few_tokens):
    net, idx, original = few_tokens
    model = original.copy()
    plan = pl.auto_place(model, devices=2, tensor_parallel=2, cost="flops", throughput=SPEED, links="nvlink")
    assert plan.tensor_parallel == [2] and not plan.tp_choices
    assert [r.degree for r in plan.devices] == [2, 2]
    assert all(r.collective_time == plan.collective_time for r in plan.devices)
    weights = sum(v.const_value.nbytes for v in original.graph.initializers.values())
    assert all(0.4 * weights < r.param_bytes < 0.55 * weights for r in plan.devices)  # shards + replicated
    _outputs_equal(model, net, idx)
    rows = pl.summary(model).rows
    assert [r.collectives for r in rows] == [6, 5]  # the logits are gathered on the first device


def test_default_is_unchanged(few_tokens):
    _, _, original = few_tokens
    a, b = original.copy(), original.copy()
    plan = pl.auto_place(a, devices=2, cost="flops")
    again = pl.auto_place(b, devices=2, cost="flops", tensor_parallel=None)
    assert plan == again and plan.tensor_parallel == [] and plan.collective_time == 0
    assert "tensor parallel" not in str(plan)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"devices": 4, "tensor_parallel": 3}, "positive divisor of the device count 4"),
        ({"devices": 2, "tensor_parallel": "yes"}, "must be 'auto' or a degree"),
        ({"devices": 2, "tensor_parallel": True}, "must be 'auto' or a degree"),
        ({"devices": 2, "tensor_parallel": 2, "cost": "size"}, "weighs times"),
    ],
)
def test_bad_arguments(few_tokens, options, message):
    _, _, original = few_tokens
    model = original.copy()
    with pytest.raises(PlanError, match=message):
        pl.auto_place(model, **{"cost": "flops", **options})
    assert [str(d) for d in model.devices] == ["cuda:0"]


def test_candidates():
    assert candidate_degrees(1, "auto") == [1]
    assert candidate_degrees(6, "auto") == [1, 2, 3, 6]
    assert candidate_degrees(4, 2) == [2]


def test_predict_weighs_degrees_on_nvlink(many_tokens, few_tokens):
    """Tiny tokens per step: latency-bound, degree 1; many: a split stage, collectives included."""
    nvlink = {"links": "nvlink", "throughput": {"cuda": 1e11}}
    small = pl.predict(few_tokens[2], gpus=[2, 4], tensor_parallel="auto", **nvlink)
    assert [p.extra["tensor_parallel"] for p in small] == [[1], [1]]
    big = pl.predict(many_tokens[2], gpus=[2, 4, 8], tensor_parallel="auto", **nvlink)
    single = big[0].single_s
    for p in big:
        assert p.extra["tensor_parallel"][0] > 1 and p.speedup > 1
        assert p.single_s == pytest.approx(single)  # the unsplit work, whatever the split
        assert p.step_s == pytest.approx(p.stage_s[0]) and 0 < p.extra["collective_s"][0] < p.stage_s[0]
    fixed = pl.predict(many_tokens[2], gpus=4, tensor_parallel=2, **nvlink)[0]
    assert fixed.extra["tensor_parallel"][0] == 2 and all(len(g) == 2 for g in fixed.extra["groups"])


def test_a_degree_the_pass_cannot_split_is_left_out_of_auto(few_tokens):
    """2 heads over 3 devices: ``"auto"`` keeps degree 1; the degree asked for is an error."""
    _, _, original = few_tokens
    plan = pl.auto_place(original.copy(), devices=3, tensor_parallel="auto", cost="flops")
    assert plan.tensor_parallel == [1] and list(plan.tp_choices) == ["1"]
    model = original.copy()
    with pytest.raises(InputError, match="2 heads cannot be spread over 3 devices"):
        pl.auto_place(model, devices=3, tensor_parallel=3, cost="flops")
    assert [str(d) for d in model.devices] == ["cuda:0"] and not any(op.is_copy for op in model.ops)


def test_measured_times_and_typical_links():
    """``cost="time"``: profiled op times; GPUs named in a list talk over PCIe by default."""
    from placement.models import mlp

    net, (x,) = mlp.build("tiny")
    model = pl.from_torch(net, (x,))
    plan = pl.auto_place(model, devices=["cuda:0", "cuda:1"], tensor_parallel=2, repeats=2)
    assert plan.cost_kind == "time" and plan.tensor_parallel == [2]
    # two collectives, each at least a PCIe copy's latency plus the fixed latency
    assert plan.collectives == 2 and plan.collective_time >= 2 * (10_000 + 50_000)
    (out,) = pl.Runner(model, device_map={0: "cpu", 1: "cpu"}, fold=False).run([x])
    np.testing.assert_allclose(out, net(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_layer_bigger_than_a_device_fits_when_split():
    """A 256 KiB linear against 200 KiB per device: no pipeline fits, a split over 2 does."""
    from placement.errors import InfeasiblePlacementError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)).eval()
    x = torch.randn(4, 64)
    model = pl.from_torch(net, (x,))
    with pytest.raises(InfeasiblePlacementError):
        pl.auto_place(model.copy(), max_memory={0: "200KiB", 1: "200KiB"}, cost="flops")
    plan = pl.auto_place(model, max_memory={0: "200KiB", 1: "200KiB"}, tensor_parallel="auto", cost="flops")
    assert plan.tensor_parallel == [2] and list(plan.tp_choices) == ["2"] and plan.fits
    assert all(r.budget == 200 * 1024 and r.memory <= r.budget for r in plan.devices)
    (out,) = pl.Runner(model, device_map={0: "cpu", 1: "cpu"}, fold=False).run([x])
    np.testing.assert_allclose(out, net(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(
        InfeasiblePlacementError, match="no tensor-parallel degree fits: degree 1: .*degree 2:"
    ):
        pl.auto_place(pl.from_torch(net, (x,)), max_memory={0: "100KiB", 1: "100KiB"}, tensor_parallel="auto",
                      cost="flops")  # fmt: skip


@pytest.mark.parametrize("tensor_parallel", ["auto", 2])
def test_a_failed_plan_leaves_the_model_unchanged(tensor_parallel):
    """No degree fits the budgets: the error leaves the user's model as it was (no split, no
    copies, no devices assigned), whether the degree was weighed or asked for."""
    from placement.errors import InfeasiblePlacementError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)).eval()
    model = pl.from_torch(net, (torch.randn(4, 64),))
    ops = [(op.name, str(op.device)) for op in model.ops]
    with pytest.raises(InfeasiblePlacementError):
        pl.auto_place(
            model, max_memory={0: "100KiB", 1: "100KiB"}, tensor_parallel=tensor_parallel, cost="flops"
        )
    assert [(op.name, str(op.device)) for op in model.ops] == ops
    assert [str(d) for d in model.devices] == ["cuda:0"] and not any(op.is_copy for op in model.ops)
